"""Re-export every engine replica's own `vllm:*` metrics through the router's `/metrics`.

Each replica renders its process's Prometheus registry; the router keeps the `vllm:` families,
labels every sample with the replica it came from, and merges same-named families into one (a
Prometheus exposition may name a family only once).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX = "vllm:"


class _Static:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of the `vllm:*` families of every replica, with a `replica` label."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(PREFIX):
                continue
            target = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            target.samples.extend(
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    if not merged:
        return ""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(list(merged.values())))
    return generate_latest(registry).decode()
