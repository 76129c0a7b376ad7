"""An engine replica's document sessions: which are reaped as orphans, and what closing one
under a running query does (fake backend, no engine; `tests/wim/test_jobs_give_back.py` closes one
on the real engine)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fakes.engine import DOC, FakeBackend, options
from wim_service.serving.replica.held_documents import HeldDocuments
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.orchestrator import open_document

QUERY = "Which sentence is about the harbour?"


class FakeSession:
    def __init__(self, busy: bool = False) -> None:
        self.busy = busy
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_an_unclaimed_session_is_reaped_unless_a_query_uses_it() -> None:
    held = HeldDocuments(orphan_timeout_s=60)
    idle, querying, claimed = FakeSession(), FakeSession(busy=True), FakeSession()
    for name, session in (("idle", idle), ("querying", querying), ("claimed", claimed)):
        await held.open(name, reader(session), lambda: 0)
    assert held.claim(["claimed", "elsewhere"], now=50) == 1
    assert held.orphans(now=59) == []
    # Unclaimed past the timeout: only the idle one goes. A query in flight came through a
    # router that holds the session, whether or not that router can list it now.
    assert await held.reap(now=100) == ["idle"]
    assert (idle.closed, querying.closed, claimed.closed) == (True, False, False)
    assert len(held) == 2
    # Its query ended at 100 (the replica counts it as a claim): the timeout runs from there.
    querying.busy = False
    assert held.use("querying", now=100) is querying
    assert held.orphans(now=159) == ["claimed"]  # last claimed at 50
    assert held.orphans(now=161) == ["querying", "claimed"]


def reader(session: Any, started: asyncio.Event | None = None) -> Any:
    """A read of a document that makes `session`, counted in `session.reads`."""

    async def read() -> Any:
        session.reads = getattr(session, "reads", 0) + 1
        if started is not None:
            started.set()
            await asyncio.sleep(0.05)
        return session

    return read


async def test_a_document_is_read_once_however_many_open_it() -> None:
    """Two routers failing one session over onto this replica at once, or a copy opened where
    one is held: one read, one session, and nothing closed under the first one's queries."""
    held = HeldDocuments()
    first, second = FakeSession(), FakeSession()
    both = await asyncio.gather(
        held.open("doc", reader(first, asyncio.Event()), lambda: 0),
        held.open("doc", reader(second), lambda: 0),
    )
    assert both == [first, first] and first.reads == 1 and not hasattr(second, "reads")
    # Held already: returned as it is, claimed now, not read again and not closed.
    assert await held.open("doc", reader(second), lambda: 70) is first
    assert held.orphans(now=100) == [] and not first.closed and len(held) == 1
    assert await held.close("doc") and first.closed and len(held) == 0


class SlowRead:
    """A read that stalls until `finish` is set, and records how it ended."""

    def __init__(self) -> None:
        self.started, self.finish = asyncio.Event(), asyncio.Event()
        self.session = FakeSession()
        self.cancelled = False

    async def __call__(self) -> Any:
        self.started.set()
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.cancelled = True  # the real read closes its context here (open_document)
            raise
        return self.session


async def test_a_read_its_callers_left_is_cancelled_and_holds_nothing() -> None:
    held = HeldDocuments(orphan_timeout_s=60)
    read = SlowRead()
    opening = asyncio.create_task(held.open("doc", read, lambda: 5))
    await read.started.wait()
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    # Cancelled with its caller, not held for the reaper a minute later.
    assert read.cancelled and len(held) == 0 and held.orphans(now=10**6) == []
    # The next open reads again.
    again = SlowRead()
    again.finish.set()
    assert await held.open("doc", again, lambda: 6) is again.session and len(held) == 1


async def test_a_shared_read_goes_on_while_one_of_its_callers_waits() -> None:
    held = HeldDocuments()
    read = SlowRead()
    first = asyncio.create_task(held.open("doc", read, lambda: 0))
    await read.started.wait()
    second = asyncio.create_task(held.open("doc", SlowRead(), lambda: 0))
    await asyncio.sleep(0)  # the second caller joins the read in flight
    first.cancel()
    await asyncio.sleep(0)
    assert not read.cancelled
    read.finish.set()
    assert await second is read.session and len(held) == 1 and first.cancelled()


async def test_closing_a_document_while_it_is_read_stops_the_read_at_once() -> None:
    """A DELETE (or a router's clean-up) during a read frees its KV now, not a minute later
    when the reaper would find the session it left."""
    held = HeldDocuments()
    read = SlowRead()
    opening = asyncio.create_task(held.open("doc", read, lambda: 0))
    await read.started.wait()
    assert await held.close("doc") and read.cancelled
    with pytest.raises(WiMError) as failure:
        await opening
    assert failure.value.code == ErrorCode.NOT_FOUND and len(held) == 0
    assert await held.close("doc") is False


class SlowClose(SlowRead):
    """A read whose cancellation takes a while to unwind (the engine frees its context)."""

    def __init__(self) -> None:
        super().__init__()
        self.unwound = asyncio.Event()

    async def __call__(self) -> Any:
        try:
            return await super().__call__()
        except asyncio.CancelledError:
            await self.unwound.wait()
            raise


async def test_an_open_while_an_abandoned_read_unwinds_reads_anew() -> None:
    """Its last caller gone, a read is cancelled and takes a while to close its context; a
    caller that opens the document meanwhile gets a read of its own, not that cancellation."""
    held = HeldDocuments()
    dying = SlowClose()
    opening = asyncio.create_task(held.open("doc", dying, lambda: 0))
    await dying.started.wait()
    opening.cancel()
    while not dying.cancelled:  # the read is cancelled (loop turns, no clock), and unwinds
        await asyncio.sleep(0)
    fresh = SlowRead()
    fresh.finish.set()
    again = asyncio.create_task(held.open("doc", fresh, lambda: 0))
    await asyncio.sleep(0)
    dying.unwound.set()
    assert await again is fresh.session and len(held) == 1
    assert opening.cancelled()


async def test_a_read_cancelled_before_it_started_leaves_no_read_in_flight() -> None:
    held = HeldDocuments()
    opening = asyncio.create_task(held.open("doc", SlowRead(), lambda: 0))
    await asyncio.sleep(0)  # awaiting the read, whose task has not run a step yet
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    read = SlowRead()
    read.finish.set()
    assert await held.open("doc", read, lambda: 0) is read.session


async def test_a_failed_read_holds_nothing_and_the_next_open_reads_again() -> None:
    held = HeldDocuments()

    async def failing() -> Any:
        raise WiMError(ErrorCode.OVERLOADED, "no room")

    with pytest.raises(WiMError):
        await held.open("doc", failing, lambda: 0)
    session = FakeSession()
    assert len(held) == 0 and await held.open("doc", reader(session), lambda: 0) is session


async def test_closing_a_session_under_a_query_ends_the_query_with_not_found(tokenizer) -> None:
    backend = FakeBackend(tokenizer, lambda params, prefix: "YES the harbour.")
    session = await open_document(backend, tokenizer, DOC, options())
    held = HeldDocuments()
    await held.open("doc", reader(session), lambda: 0)
    assert not session.busy
    backend.gate.clear()  # the query's margins start, then stall
    events = []

    async def consume() -> None:
        events.extend([e async for e in session.query(QUERY)])

    querying = asyncio.create_task(consume())
    while not backend.requests:
        await asyncio.sleep(0.01)
    assert session.busy and held.orphans(now=10**6) == []
    assert await held.close("doc")
    await asyncio.wait_for(querying, 10)
    # The stream ends with an error that says why, not cut off and not with an answer.
    assert events[-1].type == "error" and events[-1].code == ErrorCode.NOT_FOUND.value
    assert not session.busy
    # Every margin request ended, and the reservation went back exactly once.
    log = backend.log
    assert sum(e[0] == "start" for e in log) == sum(e[0] == "end" for e in log) > 0
    assert backend.contexts[0].closed and backend.reserved_blocks == 0
    assert await held.close("doc") is False
