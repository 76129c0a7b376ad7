"""The router's logic: document sessions, placement, failover, sizing, tenant quotas."""
