"""Scaling engine replicas on what fills them: reserved KV, not only running requests.

A parked document session holds KV while no request runs, so Serve's request-count policy
alone would see an idle service while every replica's KV is committed and new sessions get
429. Each `EngineReplica` reports the share of its KV that is reserved and the share of its
session slots (`max_sessions`) in use (`record_autoscaling_stats`): a replica is as full as the
fuller of the two, since either refuses the next session. This policy asks for as many
replicas as the requests *or* that fullness need, whichever is more. Serve applies min/max
replicas and the up/down delays.

Ray Serve pickles this module by value into its controller: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

# The custom metrics each EngineReplica reports: reserved KV blocks / its KV capacity, and
# sessions admitted / its max_sessions.
KV_RESERVED_FRACTION = "kv_reserved_fraction"
SESSION_FRACTION = "session_fraction"


class KVAwarePolicy:
    """`autoscaling_config.policy.policy_function` for EngineReplica.

    `target_kv_fraction`: the share of each replica's KV (or of its session slots, whichever
    is fuller) to aim for; above it a replica is added (before sessions are refused).
    """

    def __init__(self, target_kv_fraction: float = 0.6) -> None:
        if not 0 < target_kv_fraction <= 1:
            raise ValueError("target_kv_fraction must be in (0, 1]")
        self.target_kv_fraction = target_kv_fraction

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        by_requests = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        metrics = ctx.aggregated_metrics or {}
        kv = metrics.get(KV_RESERVED_FRACTION, {})
        slots = metrics.get(SESSION_FRACTION, {})
        full = [max(kv.get(r, 0.0), slots.get(r, 0.0)) for r in kv.keys() | slots.keys()]
        # In replicas' worth of fullness: 1.0 is one replica full.
        by_fill = sum(full) / self.target_kv_fraction
        desired = max(by_requests, by_fill)
        if desired < current and ctx.total_num_requests > 0:
            # Scale down only while no request runs: the sessions of the leaving replica are
            # then idle and move on their next query, none is cut short mid-answer.
            desired = current
        return desired, {}
