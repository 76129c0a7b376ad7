"""Metrics: the Prometheus registry, event-loop lag, the engines' own metrics."""
