"""Calls to engine replicas that end when the router takes their replica for lost.

Ray tells a caller that an actor died through the GCS. While the GCS is down nobody does: a
call to a replica whose node is gone stays "temporarily unavailable" in Serve's request router
until the GCS is back, which a fault-tolerant head may take minutes to be. So the router judges
a replica by its own evidence, its load polls (`routing/fleet.py`), and `WatchedClient.condemn`
ends every call open on a replica it has taken for lost with `ReplicaSilent` (a
`ReplicaLost`): the job fails over
at once instead of waiting for Ray.

No call is bounded by its total time: a long document read or a long answer on a replica that
keeps answering its polls runs to its end, however long it takes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from wim_service.serving.replica.client import ReplicaClient, ReplicaLost
from wim_service.serving.replica.protocol import CallsByName
from wim_service.wim.events import WiMEvent

T = TypeVar("T")


class ReplicaSilent(ReplicaLost):
    """The router took the replica for lost while this call ran: it stopped answering."""


class WatchedClient(CallsByName):
    """`ReplicaClient` over another one, whose open calls on a replica `condemn` ends."""

    def __init__(self, inner: ReplicaClient) -> None:
        self.inner = inner
        self.in_flight = inner.in_flight
        # replica -> the verdicts its open calls wait on, one per call, made on the call's own
        # event loop (an Event kept across calls binds to the loop that first waits on it)
        self._verdicts: dict[str, set[asyncio.Future[None]]] = {}

    async def live_replicas(self) -> frozenset[str]:
        return await self.inner.live_replicas()

    def condemn(self, replica: str) -> None:
        """End every call open on `replica` with `ReplicaSilent`; calls made later run."""
        for verdict in self._verdicts.pop(replica, set()):
            if not verdict.done():
                verdict.set_result(None)

    async def call(self, replica: str, method: str, *args: Any) -> Any:
        return await self._watched(replica, getattr(self.inner.replica(replica), method)(*args))

    async def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
        events: AsyncIterator[WiMEvent] = getattr(self.inner.replica(replica), method)(*args)
        try:
            while True:
                event = await self._watched(replica, _next(events))
                if event is None:
                    return
                yield event
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watched(self, replica: str, awaitable: Awaitable[T]) -> T:
        verdict: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._verdicts.setdefault(replica, set()).add(verdict)
        call = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((call, verdict), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._verdicts.get(replica, set()).discard(verdict)
            if not call.done():
                call.cancel()
                # Its cleanup runs first (a stream's generator is idle again, a Serve call is
                # cancelled on its replica), whether the verdict or our own caller ended it.
                await asyncio.wait((call,))
        if call.cancelled() and verdict.done() and not verdict.cancelled():
            silent = TimeoutError(f"engine replica {replica} stopped answering its load calls")
            raise ReplicaSilent(replica, silent) from silent
        return call.result()


async def _next(events: AsyncIterator[WiMEvent]) -> WiMEvent | None:
    """The stream's next event, or None at its end."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
