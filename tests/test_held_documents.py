"""An engine replica's document sessions: which are reaped as orphans, and what closing one
under a running query does (fake backend, no engine; `tests/test_trust_engine.py` closes one
on the real engine)."""

from __future__ import annotations

import asyncio

from tests.test_orchestrator import DOC, FakeBackend, options
from wim_service.serving.replica.held_documents import HeldDocuments
from wim_service.wim.errors import ErrorCode
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
        await held.add(name, session, now=0)  # type: ignore[arg-type]
    assert held.claim(["claimed", "elsewhere"], now=50) == 1
    assert held.orphans(now=59) == []
    # Unclaimed past the timeout: only the idle one goes. A query in flight came through a
    # router that holds the session, whether or not that router can list it now.
    assert await held.reap(now=100) == 1
    assert (idle.closed, querying.closed, claimed.closed) == (True, False, False)
    assert len(held) == 2
    # Its query ended at 100 (the replica counts it as a claim): the timeout runs from there.
    querying.busy = False
    assert held.use("querying", now=100) is querying
    assert held.orphans(now=159) == ["claimed"]  # last claimed at 50
    assert held.orphans(now=161) == ["querying", "claimed"]


async def test_a_second_open_of_one_document_closes_the_first() -> None:
    """Two opens of one document ran at once on this replica (two routers copying a hot
    document): the one held last stays, the other is closed, not left pinned for nobody."""
    held = HeldDocuments()
    first, second = FakeSession(), FakeSession()
    await held.add("doc", first, now=0)  # type: ignore[arg-type]
    await held.add("doc", second, now=1)  # type: ignore[arg-type]
    assert (first.closed, second.closed, len(held)) == (True, False, 1)
    assert held.use("doc", now=2) is second
    assert await held.close("doc") and second.closed and len(held) == 0


async def test_closing_a_session_under_a_query_ends_the_query_with_not_found(tokenizer) -> None:
    backend = FakeBackend(tokenizer, lambda params, prefix: "YES the harbour.")
    session = await open_document(backend, tokenizer, DOC, options())
    held = HeldDocuments()
    await held.add("doc", session, now=0)
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
