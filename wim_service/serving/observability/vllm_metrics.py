"""Re-export every engine replica's own metrics through the router's `/metrics`.

Each replica renders its process's Prometheus registry, its own event-loop lag and its stored
KV counts; the router keeps the `vllm:` families, the replicas' stored-KV families (`wim_kv_*`,
`StoredKVMetrics`) and those it exports itself too (`wim_event_loop_lag_seconds`), labels
every sample with the replica it came from, and merges same-named families into one (a
Prometheus exposition may name a family only once), its own included.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# Families kept from the replicas besides those the router exports too.
PREFIXES = ("vllm:", "wim_kv_")


class _Static:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_replica_metrics(own: list[Metric], texts: dict[str, str]) -> str:
    """Prometheus text of the router's families `own` (collected from its registry) and of
    every replica's `vllm:*` and `wim_kv_*` families and families that `own` has too, the
    replicas' samples with a `replica` label."""
    merged: dict[str, Metric] = {family.name: family for family in own}
    shared = set(merged)
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(PREFIXES) and family.name not in shared:
                continue
            target = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            target.samples.extend(
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(list(merged.values())))
    return generate_latest(registry).decode()
