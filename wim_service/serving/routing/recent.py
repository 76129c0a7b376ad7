"""`Recent`: one async fetch's result, shared by the callers that come close together.

The public probes and scrapes (`/readyz`, `/metrics`) ask every engine replica something. Each
request doing so itself would let any rate of anonymous requests multiply calls to the
engines, which take request slots there; through a `Recent` they cost at most one round of
calls per `max_age_s`, however many arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Recent(Generic[T]):
    """`fetch()`'s last result while it is at most `max_age_s` old; callers that find it
    older share one new fetch (a failed fetch fails its waiters and is not kept)."""

    def __init__(self, fetch: Callable[[], Awaitable[T]], max_age_s: float) -> None:
        self._fetch = fetch
        self.max_age_s = max_age_s
        self._last: tuple[float, T] | None = None
        self._pending: asyncio.Task[T] | None = None

    async def get(self) -> T:
        if self._last is not None and time.monotonic() - self._last[0] <= self.max_age_s:
            return self._last[1]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._run())
        # A caller that goes away (a client disconnect) must not cancel the others' fetch.
        return await asyncio.shield(self._pending)

    async def _run(self) -> T:
        value = await self._fetch()
        self._last = (time.monotonic(), value)
        return value
