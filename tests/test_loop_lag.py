"""`wim_event_loop_lag_seconds`: the loop monitor on a loop blocked on purpose, and its task
on shutdown."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from wim_service.serving.loop_lag import LoopLagMonitor
from wim_service.serving.metrics import event_loop_lag

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
