"""The real router and its HTTP app over fake replicas (`tests/fakes/replicas.py`), and what the
tests read of it: a metric of its `/metrics` page, or one of its registry without a scrape."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.fakes.replicas import FakeClient, FakeReplica
from wim_service.serving.ingress import build_http_app
from wim_service.serving.routing.router import WiMRouter


def make_service(*replicas: FakeReplica, **router: Any) -> tuple[TestClient, WiMRouter]:
    # Every scrape renders at once: the tests read the metrics right after what moves them.
    config = {"router": {"replica_wait_s": 0, "metrics_interval_s": 0, **router}}
    wim_router = WiMRouter(None, config, client=FakeClient(*replicas), http_host="127.0.0.1")
    return TestClient(build_http_app(wim_router)), wim_router


def metric(client: TestClient, name: str, **labels: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def counted(router: WiMRouter, name: str, **labels: str) -> float:
    """A sample of the router's metrics read from its registry, without a scrape (0 if none)."""
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


class UnnoticedDeaths(FakeClient):
    """Serve still routes to a dead replica (its controller has not noticed yet)."""

    async def live_replicas(self) -> frozenset[str]:
        return frozenset(self.replicas)
