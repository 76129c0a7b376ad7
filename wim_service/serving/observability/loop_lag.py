"""`LoopLagMonitor`: how late an event loop gets round to what it was asked to run.

Anything that holds the loop (a quadratic regex on a hostile request, a synchronous call, a
large JSON encoding) delays every other coroutine on it by as long: `/healthz`, streams, load
polls. A task that sleeps a fixed interval wakes that much later than asked, so the lateness of
its wake is the loop's lag. A stall is recorded when it ends, as one late wake; while it lasts
nothing on the loop, the monitor included, can report it.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

# A stall is measured short by what was left of the sleep when it began, at most the interval:
# a quarter second is small beside the 1 s the alert watches for, and 4 wakes a second cost
# nothing.
INTERVAL_S = 0.25


class LoopLagMonitor:
    """Records into `lag` (one series of `wim_event_loop_lag_seconds`) how late the loop it was
    started on wakes from each `interval_s` sleep, from `start()` to `stop()`."""

    def __init__(self, lag: Histogram, interval_s: float = INTERVAL_S) -> None:
        self.lag = lag
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch the running loop; a no-op while already watching."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        """Stop watching. Synchronous, for a sync `__del__`: the task's sleep is cancelled, so
        it ends at the loop's next turn. A no-op when not watching (`__del__` may run twice)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            # asyncio runs a timer up to its clock resolution early: no negative lag.
            self.lag.observe(max(0.0, loop.time() - due))
