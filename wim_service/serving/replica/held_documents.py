"""The document sessions one engine replica holds, and the rule that closes orphans.

Routers claim the sessions bound to a replica every load poll (`WiMRouter._claim_documents`);
one that no router claimed for `orphan_timeout_s` belongs to a router that is gone (restarted
without a shared store, or with its store lost), and its KV would stay pinned for nobody. A
session with a query running or waiting is never an orphan: that query came through a router
that holds the session now, even if that router cannot list its sessions (its store is down).
A document id names one text read with fixed options: a replica reads it once (`open`).

Free of Ray, so that the rule is tested without a replica
(`tests/serving/replica/test_held_documents.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.orchestrator import WiMSession

logger = logging.getLogger(__name__)

DEFAULT_ORPHAN_TIMEOUT_S = 60.0

Clock = Callable[[], float]  # monotonic seconds


@dataclass
class _Held:
    session: WiMSession
    claimed: float  # monotonic time a router last said it holds this session, or used it


@dataclass
class _Reading:
    """A read in flight, shared by every caller that opened its document meanwhile."""

    task: asyncio.Task[WiMSession]
    waiters: int = 0  # callers awaiting it now
    closed: bool = False  # closed (DELETE, expiry, a router's clean-up) before it ended
    # Cancelled (closed, or every caller left) and still unwinding: closing its context takes
    # the engine a while, and a caller that comes meanwhile must not join a read that ends
    # in a cancellation it did not ask for.
    ending: bool = False


class HeldDocuments:
    """Document id -> its session on this replica, with when it was last claimed."""

    def __init__(self, orphan_timeout_s: float = DEFAULT_ORPHAN_TIMEOUT_S) -> None:
        self.orphan_timeout_s = orphan_timeout_s
        self._held: dict[str, _Held] = {}
        self._reading: dict[str, _Reading] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, document_id: object) -> bool:
        return document_id in self._held

    def sessions(self) -> Iterator[WiMSession]:
        return (held.session for held in self._held.values())

    async def open(
        self, document_id: str, read: Callable[[], Awaitable[WiMSession]], clock: Clock
    ) -> WiMSession:
        """`document_id`'s session, read by `read` only if this replica neither holds it nor
        is reading it. A document id names one text read with options fixed at its upload,
        so a session held under it is the one a second read would make: two routers failing
        one session over onto this replica at once (or a copy opened where a stale one is
        left) share one read. Closing the held one to read it again would end the other
        router's queries on it, which then took this live replica for a lost one.

        The read is shared, so one caller going away does not stop it; the last one going
        away cancels it, which frees its KV and its session slot at once: a read whose client
        is gone holds nothing for nobody. A read closed meanwhile (`close`) ends its callers
        with `NOT_FOUND`."""
        held = self.use(document_id, clock())
        if held is not None:
            return held
        reading = self._reading.get(document_id)
        # One that ended is left until its done callback runs: a success is held by now.
        if reading is None or reading.task.done() or reading.ending:
            reading = self._start_read(document_id, read, clock)
        reading.waiters += 1
        try:
            return await asyncio.shield(reading.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if reading.closed and current is not None and not current.cancelling():
                raise WiMError(
                    ErrorCode.NOT_FOUND, "the document session was closed while it was read"
                ) from None
            raise
        finally:
            reading.waiters -= 1
            if reading.waiters == 0 and not reading.task.done():
                reading.ending = True
                reading.task.cancel()  # every caller left: nobody would ever query it

    def _start_read(
        self, document_id: str, read: Callable[[], Awaitable[WiMSession]], clock: Clock
    ) -> _Reading:
        async def hold() -> WiMSession:
            session = await read()
            self._held[document_id] = _Held(session, clock())
            return session

        reading = self._reading[document_id] = _Reading(asyncio.ensure_future(hold()))

        def ended(task: asyncio.Task[WiMSession]) -> None:
            # Here, not in `hold`: a read cancelled before its first step never runs `hold`.
            if self._reading.get(document_id) is reading:
                del self._reading[document_id]
            # A failed read whose callers all left is not an "exception never retrieved".
            if not task.cancelled():
                task.exception()

        reading.task.add_done_callback(ended)
        return reading

    def use(self, document_id: str, now: float) -> WiMSession | None:
        """The session, counted as claimed now (a query came for it through a router)."""
        held = self._held.get(document_id)
        if held is None:
            return None
        held.claimed = now
        return held.session

    def claim(self, document_ids: list[str], now: float) -> int:
        """A router holds these sessions; returns how many of them are here."""
        here = 0
        for document_id in document_ids:
            held = self._held.get(document_id)
            if held is not None:
                held.claimed = now
                here += 1
        return here

    def _orphan(self, held: _Held, now: float) -> bool:
        return held.claimed < now - self.orphan_timeout_s and not held.session.busy

    def orphans(self, now: float) -> list[str]:
        """Sessions nobody claimed for `orphan_timeout_s`, and that no query uses."""
        return [d for d, held in self._held.items() if self._orphan(held, now)]

    async def close(self, document_id: str) -> bool:
        """Close a session, stopping a query that runs on it, or stop its read in flight (its
        callers get `NOT_FOUND`) once its KV is freed; False if it is neither here nor read."""
        reading = self._reading.get(document_id)
        if reading is not None and not reading.task.done():
            reading.closed = reading.ending = True
            reading.task.cancel()
            # Its read closes its context on the way out: the KV is free when this returns.
            await asyncio.wait([reading.task])
            return True
        held = self._held.pop(document_id, None)
        if held is None:
            return False
        await held.session.close()
        return True

    async def reap(self, now: float) -> list[str]:
        """Close the orphans; returns the ids closed."""
        closed: list[str] = []
        for document_id in self.orphans(now):
            held = self._held.get(document_id)
            # Closing the ones before yielded: this one may have been claimed or queried since.
            if held is not None and self._orphan(held, now) and await self.close(document_id):
                closed.append(document_id)
        if closed:
            logger.info("closed %d document sessions no router claims", len(closed))
        return closed
