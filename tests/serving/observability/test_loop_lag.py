"""`wim_event_loop_lag_seconds`: the loop monitor on a loop blocked on purpose, its task on
shutdown, and the router's `/metrics` with its own lag and an engine replica's (fakes, no Ray).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest

from tests.fakes.replicas import FakeReplica
from tests.fakes.router import make_service, metric
from wim_service.serving.observability.loop_lag import LoopLagMonitor
from wim_service.serving.observability.metrics import event_loop_lag

LAG = "wim_event_loop_lag_seconds"
# Short, so that the deliberate block is measured short by at most this much.
INTERVAL_S = 0.05


async def test_a_blocked_loop_is_recorded_as_lag_in_its_series() -> None:
    registry = CollectorRegistry()
    labels = {"deployment": "replica", "replica": "r1"}

    def sample(suffix: str, **le: str) -> float:
        return registry.get_sample_value(LAG + suffix, labels | le) or 0.0

    def slow_wakes() -> float:
        return sample("_count") - sample("_bucket", le="0.25")

    monitor = LoopLagMonitor(event_loop_lag(registry).labels(**labels), INTERVAL_S)
    monitor.start()
    try:
        # Once it has woken, the monitor is asleep again: the block falls in its sleep.
        while sample("_count") == 0:
            await asyncio.sleep(0)
        count, total, slow = sample("_count"), sample("_sum"), slow_wakes()
        time.sleep(0.5)  # hold the loop, as a quadratic regex in a handler would
        while sample("_count") == count:
            await asyncio.sleep(0)
    finally:
        monitor.stop()
    # A wake later than a quarter second (the block's), and the block's 0.5 s, less at most
    # one interval, in the series' total lag.
    assert slow_wakes() >= slow + 1
    assert sample("_sum") - total >= 0.4


async def test_stop_ends_the_monitor_task() -> None:
    lag = event_loop_lag(CollectorRegistry()).labels("router", "r1")
    monitor = LoopLagMonitor(lag, INTERVAL_S)
    before = asyncio.all_tasks()
    monitor.start()
    monitor.start()  # already watching: no second task
    (task,) = asyncio.all_tasks() - before
    monitor.stop()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()


class LaggingReplica(FakeReplica):
    """Reports, as `EngineReplica.metrics_text` does, its loop's lag beside vLLM's metrics:
    one wake 2 s late."""

    async def metrics_text(self) -> str:
        registry = CollectorRegistry()
        event_loop_lag(registry).labels("replica", self.name).observe(2.0)
        return await super().metrics_text() + generate_latest(registry).decode()


def test_metrics_show_the_router_and_replica_loop_lag() -> None:
    client, _ = make_service(LaggingReplica("a"))
    with client:  # runs the app's lifespan, which starts the router's monitor
        assert client.get("/readyz").status_code == 200  # the router learns replica "a"
        deadline = time.monotonic() + 30
        while metric(client, LAG + "_count", deployment="router", replica="local") == 0:
            assert time.monotonic() < deadline, "the router's loop monitor took no sample"
            time.sleep(INTERVAL_S)
        assert client.get("/metrics").text.count(f"# TYPE {LAG} histogram") == 1  # one family
        assert metric(client, LAG + "_count", deployment="replica", replica="a") == 1
        assert metric(client, LAG + "_sum", deployment="replica", replica="a") == 2.0
