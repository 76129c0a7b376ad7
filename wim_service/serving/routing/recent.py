"""`Recent` and `Paced`: one async call's result, shared by the callers that come close
together.

The public probes and scrapes (`/readyz`, `/metrics`) ask every engine replica something. Each
request doing so itself would let any rate of anonymous requests multiply calls to the
engines, which take request slots there; through a `Recent` they cost at most one round of
calls per `max_age_s`, however many arrive. Rendering `/metrics` costs the router itself tens
of milliseconds per engine replica: through a `Paced` it runs at most once per interval
however many scrapers come, and no scraper gets a page older than its own request.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from wim_service.placement.polls import Fresh

T = TypeVar("T")


class Recent(Generic[T]):
    """`fetch()`'s last result while it is at most `max_age_s` old (`placement.polls.Fresh`,
    the rule `wim sim` keeps its asks for loads by); callers that find it older share one new
    fetch (a failed fetch fails its waiters and is not kept)."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[T]],
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._fresh = Fresh(max_age_s)
        self.clock = clock
        self._last: tuple[T] | None = None  # in a tuple: a fetch may return None
        self._pending: asyncio.Task[T] | None = None

    async def get(self) -> T:
        if self._last is not None and self._fresh.holds(self.clock()):
            return self._last[0]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._run())
        # A caller that goes away (a client disconnect) must not cancel the others' fetch.
        return await asyncio.shield(self._pending)

    async def _run(self) -> T:
        value = await self._fetch()
        self._fresh.took(self.clock())
        self._last = (value,)
        return value


class Paced(Generic[T]):
    """`render()` at most once per `interval_s` (from one start to the next), its result
    shared: every caller gets the result of a render that started after it called, so that
    nothing done before it asked is missing, and callers that come together share one render
    (a failed render fails its waiters). A caller that comes sooner than `interval_s` after
    the last render started waits for the next one."""

    def __init__(self, render: Callable[[], Awaitable[T]], interval_s: float) -> None:
        self._render = render
        self.interval_s = interval_s
        self._started = -math.inf
        self._last: tuple[float, T] | None = None
        self._pending: asyncio.Task[tuple[float, T]] | None = None

    async def get(self) -> T:
        called = time.monotonic()
        last = self._last
        while last is None or last[0] < called:
            if self._pending is None or self._pending.done():
                self._pending = asyncio.get_running_loop().create_task(self._run())
            # A caller that goes away (a client disconnect) must not cancel the others' render.
            last = await asyncio.shield(self._pending)
        return last[1]

    async def _run(self) -> tuple[float, T]:
        wait = self._started + self.interval_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # the pace itself: one render per interval
        self._started = time.monotonic()
        self._last = (self._started, await self._render())
        return self._last
