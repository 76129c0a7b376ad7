"""Copies of hot documents (`serving/routing/copies.py`) over scripted fake replicas: a busy
document gets a copy on another replica, its queries are shared between the holders, an idle
copy is retired, DELETE closes every copy, a lost primary's copy takes over and a lost copy
is dropped — no Ray, no engine. The Redis backend's copy operations are in
tests/serving/store/test_session_store.py; a copy over Redis through two routers is at the end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fakes.fake_service import ScriptedClient, ScriptedReplica
from tests.fakes.router import counted
from tests.serving.routing.test_router_store import Routers, open_document, query, routers  # noqa: F401
from wim_service.serving.errors import ServiceError
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoredSession
from wim_service.wim.events import ErrorEvent
from wim_service.wim.options import WiMOptions

TEXT = "The night gate code is 4417. Ask Marta at the harbour office about it. " * 30
QUERY = "What is the night gate code?"


async def router_over(*replicas: ScriptedReplica, **config: Any) -> WiMRouter:
    settings = {
        "replica_wait_s": 0,
        "load_poll_interval_s": 3600,
        "placement": "expected_wait",
        **config,
    }
    router = WiMRouter(
        None,
        {"router": settings},
        client=ScriptedClient(*replicas, delay_s=0.005),
        http_host="127.0.0.1",
    )
    await router.fleet.refresh_loads()
    return router


async def opened(router: WiMRouter) -> str:
    session = StoredSession("doc-hot", WiMOptions(), ttl_s=600.0)
    return (await router.dispatcher.open_document(session, TEXT)).session_id


async def ask(router: WiMRouter, document_id: str) -> str:
    """Where one query of the document ran (it must answer)."""
    record = await router.documents.get(document_id)
    items = [
        item
        async for item in router.dispatcher.job(document_id, QUERY, WiMOptions(), record=record)
    ]
    assert items[-1][1].type == "done"
    (replica,) = {replica for replica, _ in items}
    return replica


async def hot(router: WiMRouter, document_id: str, queries: int = 6) -> list[str]:
    """`queries` concurrent queries of the document: where each ran."""
    return list(await asyncio.gather(*(ask(router, document_id) for _ in range(queries))))


async def test_a_hot_document_gets_a_copy_and_its_queries_are_shared() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, max_copies=2)
    document_id = await opened(router)
    assert await ask(router, document_id) == "a"  # alone: where the document is
    assert b.documents == {}
    # Queries at once: each one booked on a makes the next one's wait there longer, until
    # reading a copy on b is quicker; from then on they go to whichever holder is freer.
    ran = await hot(router, document_id)
    assert set(ran) == {"a", "b"}
    assert b.streams.count(("query_document", (document_id, QUERY, WiMOptions()))) >= 1
    session = await router.documents.get(document_id)
    assert session is not None and (session.replica, session.copies) == ("a", ("b",))
    assert document_id in b.texts  # the copy read the session's own text
    assert counted(router, "wim_document_copies_opened_total") == 1
    assert counted(router, "wim_copy_queries_total", role="copy") == ran.count("b")
    assert counted(router, "wim_copy_queries_total", role="primary") == 1 + ran.count("a")
    # Copies are claimed like the primary: b does not reap it as an orphan.
    await router._claim_documents()
    assert b.claimed == [document_id] and a.claimed == [document_id]
    # At max_copies (2 here) no third copy opens, however hot the document.
    c = ScriptedReplica("c")
    router.client.replicas["c"] = c  # type: ignore[attr-defined]
    await router.fleet.refresh_loads()
    await hot(router, document_id)
    assert c.documents == {} and counted(router, "wim_document_copies_opened_total") == 1


async def test_with_max_copies_1_or_under_sticky_a_document_is_never_copied() -> None:
    for config in ({"max_copies": 1}, {"placement": "sticky"}):
        a, b = ScriptedReplica("a"), ScriptedReplica("b")
        router = await router_over(a, b, **config)
        document_id = await opened(router)
        home = (await router.documents.get(document_id)).replica  # type: ignore[union-attr]
        assert set(await hot(router, document_id)) == {home}, config
        assert [r.name for r in (a, b) if r.documents] == [home]


async def test_round_robin_alternates_a_sessions_queries_between_replicas() -> None:
    """Round robin takes one turn per query: loads are not asked again before its copy opens
    (that would take a second turn and send the query back to the primary)."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, placement="round_robin")
    document_id = await opened(router)
    # The session's read took the first turn (a).
    assert [await ask(router, document_id) for _ in range(4)] == ["b", "a", "b", "a"]
    assert document_id in b.texts and counted(router, "wim_document_copies_opened_total") == 1


def held_reads(replica: ScriptedReplica) -> tuple[asyncio.Event, asyncio.Event]:
    """Make `replica`'s document reads wait: (set once a read waits, set to let it end)."""
    reading, read_may_end = asyncio.Event(), asyncio.Event()
    read = replica.open_document

    async def held_read(*args: Any) -> Any:
        reading.set()
        await read_may_end.wait()
        return await read(*args)

    replica.open_document = held_read  # type: ignore[method-assign]
    return reading, read_may_end


async def test_a_sessions_queries_go_on_on_its_holder_while_a_copy_is_read() -> None:
    """A copy's read takes seconds on a real engine: meanwhile the session's other queries
    start on the replica that holds it (they waited for the read when it ran under the
    session's lock), and none of them opens a second copy."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, placement="round_robin")
    document_id = await opened(router)  # read on a: round robin's first turn
    reading, read_may_end = held_reads(b)
    copying = asyncio.create_task(ask(router, document_id))  # b's turn: a copy is read there
    await asyncio.wait_for(reading.wait(), 5)
    # a's turn, then b's again: b's copy is still being read, so that query stays on a too.
    during = [await asyncio.wait_for(ask(router, document_id), 5) for _ in range(2)]
    assert during == ["a", "a"] and not copying.done()
    read_may_end.set()
    assert await copying == "b"
    assert counted(router, "wim_document_copies_opened_total") == 1
    assert counted(router, "wim_copy_queries_total", role="copy") == 1
    session = await router.documents.get(document_id)
    assert session is not None and session.copies == ("b",)
    # Every booking given back: the read's when it ended, each query's when it answered.
    loads = router.fleet.ledger.loads
    assert [(loads[r].running, round(loads[r].backlog_s, 6)) for r in "ab"] == [(0, 0), (0, 0)]


async def test_a_session_deleted_while_its_copy_is_read_leaves_nothing_open() -> None:
    """The read runs without the session's lock, so a DELETE may come first: the copy is not
    recorded, it is closed, and its query ends with the session's error."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, placement="round_robin")
    document_id = await opened(router)
    reading, read_may_end = held_reads(b)
    copying = asyncio.create_task(ask(router, document_id))
    await asyncio.wait_for(reading.wait(), 5)
    assert await router.dispatcher.close_document(document_id)
    read_may_end.set()
    with pytest.raises(ServiceError) as failure:
        await copying
    assert failure.value.status == 404
    assert a.documents == {} and b.documents == {}
    assert counted(router, "wim_document_copies_opened_total") == 0
    assert await router.documents.get(document_id) is None


async def test_a_copy_that_cannot_be_read_leaves_the_query_on_the_primary() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, placement="round_robin")
    document_id = await opened(router)

    async def full(*args: Any) -> Any:
        return ErrorEvent(code="overloaded", message="no KV free")

    b.open_document = full  # type: ignore[method-assign]
    assert await ask(router, document_id) == "a"
    assert counted(router, "wim_copy_queries_total", role="primary") == 1
    assert counted(router, "wim_document_copies_opened_total") == 0
    assert b.documents == {} and not router.dispatcher.copies._opening


async def test_no_copy_opens_on_a_stale_load() -> None:
    """A report taken while a query ran still counts it after it ended: a copy is decided on
    the replicas' loads asked again, not on the last poll's."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b)
    document_id = await opened(router)
    a.backlog_s = 30.0
    await router.fleet.refresh_loads()  # the last poll: a was busy then
    a.backlog_s = 0.0  # ... and is idle now
    assert await ask(router, document_id) == "a"
    assert b.documents == {} and counted(router, "wim_document_copies_opened_total") == 0
    # Still busy when asked again: the copy opens.
    a.backlog_s = 30.0
    await router.fleet.refresh_loads()
    await asyncio.sleep(0.3)  # older than the fresh loads the last decision was taken on
    assert await ask(router, document_id) == "b"
    assert counted(router, "wim_document_copies_opened_total") == 1


async def test_an_idle_copy_is_retired_but_never_while_a_query_runs_on_it() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, copy_idle_s=0.2)
    document_id = await opened(router)
    await hot(router, document_id)
    assert document_id in b.documents
    # A query running on the copy keeps it, however long it has been idle before.
    a.backlog_s = 30.0  # a is busy: the next query goes to the copy
    await router.fleet.refresh_loads()
    record = await router.documents.get(document_id)
    running = router.dispatcher.job(document_id, QUERY, WiMOptions(), record=record)
    assert (await anext(running))[0] == "b"
    await asyncio.sleep(0.3)
    await router._claim_documents()
    await router._retire_copies()
    assert document_id in b.documents
    assert router.metrics.registry.get_sample_value("wim_document_copies") == 1
    _ = [item async for item in running]
    # Idle for copy_idle_s since that query ended: closed on b, dropped from the session.
    await asyncio.sleep(0.3)
    await router._retire_copies()
    assert b.documents == {} and document_id in a.documents  # never the primary
    session = await router.documents.get(document_id)
    assert session is not None and session.copies == ()
    assert counted(router, "wim_document_copies_retired_total") == 1
    assert router.metrics.registry.get_sample_value("wim_document_copies") == 0


async def test_an_idle_copy_gives_its_room_to_a_new_session_before_a_refusal() -> None:
    # One session slot per replica: doc-hot's primary on a, its copy on b. A new session
    # finds no slot; the copy, idle but far from copy_idle_s, is closed for it.
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, max_copies=2, copy_idle_s=600)
    document_id = await opened(router)
    await hot(router, document_id)
    a.max_sessions = b.max_sessions = 1
    # While a query runs on the copy, it is kept: the new session is refused.
    a.backlog_s = 30.0  # a is busy: the query goes to the copy
    await router.fleet.refresh_loads()
    record = await router.documents.get(document_id)
    running = router.dispatcher.job(document_id, QUERY, WiMOptions(), record=record)
    assert (await anext(running))[0] == "b"
    other = StoredSession("doc-other", WiMOptions(), ttl_s=600.0)
    with pytest.raises(ServiceError) as refused:
        await router.dispatcher.open_document(other, TEXT)
    assert refused.value.status == 429 and document_id in b.documents
    _ = [item async for item in running]
    session = await router.dispatcher.open_document(other, TEXT)
    assert session.replica == "b" and b.documents.keys() == {"doc-other"}
    hot_session = await router.documents.get(document_id)
    assert hot_session is not None and hot_session.copies == ()
    assert counted(router, "wim_document_copies_retired_total") == 1
    # A document's primary is never reclaimed: a third session is refused.
    with pytest.raises(ServiceError) as refused:
        third = StoredSession("doc-3", WiMOptions(), ttl_s=600.0)
        await router.dispatcher.open_document(third, TEXT)
    assert refused.value.status == 429 and document_id in a.documents


async def test_delete_closes_every_copy() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b)
    document_id = await opened(router)
    await hot(router, document_id)
    assert document_id in a.documents and document_id in b.documents
    assert await router.dispatcher.close_document(document_id)
    assert a.documents == {} and b.documents == {}


async def test_a_lost_primary_is_replaced_by_its_copy_without_a_read() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b)
    document_id = await opened(router)
    await hot(router, document_id)
    reads = b.calls.count("open_document")
    a.dead = True
    await router.fleet.refresh_loads()  # Serve no longer routes to a
    assert await ask(router, document_id) == "b"
    assert b.calls.count("open_document") == reads  # no document read again
    session = await router.documents.get(document_id)
    assert session is not None and (session.replica, session.copies) == ("b", ())
    assert counted(router, "wim_session_failover_total", reason="replica_left") == 1
    assert counted(router, "wim_reprefill_tokens_total") == 0


async def test_a_copy_lost_mid_query_is_dropped_and_the_query_answered() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b)
    document_id = await opened(router)
    await hot(router, document_id)
    a.backlog_s = 30.0  # the next query goes to the copy on b
    await router.fleet.refresh_loads()
    b.dead = True  # ... which is lost when the query gets there
    assert await ask(router, document_id) == "a"
    session = await router.documents.get(document_id)
    assert session is not None and (session.replica, session.copies) == ("a", ())
    assert counted(router, "wim_session_failover_total", reason="replica_lost") == 1


@pytest.mark.parametrize("routers", ["memory", "redis"], indirect=True)
async def test_a_copy_opened_through_one_router_is_closed_by_a_delete_through_another(
    routers: Routers,  # noqa: F811
) -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    client = ScriptedClient(a, b, delay_s=0.005)
    first, router = await routers.new(client=client, placement="expected_wait")
    second, _ = await routers.new(client=client, placement="expected_wait")
    document_id = (await open_document(first, context=TEXT))["document_id"]
    answers = await asyncio.gather(*(query(first, document_id) for _ in range(6)))
    assert all(r.status_code == 200 for r in answers)
    assert {r.json()["replica"] for r in answers} == {"a", "b"}
    assert (await second.delete(f"/documents/{document_id}")).status_code == 204
    assert a.documents == {} and b.documents == {}
    assert counted(router, "wim_document_copies_opened_total") == 1


@pytest.mark.parametrize("routers", ["memory", "redis"], indirect=True)
async def test_two_routers_copying_a_document_onto_one_replica_leave_it_open(
    routers: Routers,  # noqa: F811
) -> None:
    """Both read a copy on b at once: b holds one session for the document (a replica reads
    it once: `HeldDocuments.open`), one router records it, and the other does not close it
    (it is the copy the first one sends queries to)."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    client = ScriptedClient(a, b, delay_s=0.005)
    first, one = await routers.new(client=client, placement="expected_wait")
    _, two = await routers.new(client=client, placement="expected_wait")
    await one.fleet.refresh_loads()
    await two.fleet.refresh_loads()
    document_id = (await open_document(first, context=TEXT))["document_id"]
    session = await one.documents.get(document_id)
    assert session is not None and session.replica == "a"
    opened = await asyncio.gather(
        one.dispatcher.copies._open(session, "b"), two.dispatcher.copies._open(session, "b")
    )
    assert sorted(opened) == [False, True]
    stored = await two.documents.get(document_id)
    assert stored is not None and stored.copies == ("b",)
    assert document_id in b.documents


async def test_copies_decided_and_given_up_book_nothing_on_their_replica() -> None:
    """Queries that would read a copy on b while this router already reads one there run on
    the primary: they leave b's load as its last report plus the one read, whatever their
    number. (Each one left a session slot and the session's KV booked there until the next
    report: on 4 December a node loss stalled the reports, and the session's rebuild on the
    survivor was refused 429 on those phantom bookings.)"""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b)
    document_id = await opened(router)
    a.backlog_s = 30.0  # a is busy: every query's cheapest start is a copy on b
    await router.fleet.refresh_loads()
    reading, read_may_end = held_reads(b)
    copying = asyncio.create_task(ask(router, document_id))
    await asyncio.wait_for(reading.wait(), 5)
    b_load = router.fleet.ledger.loads["b"]
    booked = (b_load.sessions, b_load.reserved_blocks)
    await asyncio.sleep(0.3)  # older than the fresh loads: each decision asks again
    during = [await asyncio.wait_for(ask(router, document_id), 5) for _ in range(3)]
    assert during == ["a", "a", "a"]
    b_load = router.fleet.ledger.loads["b"]
    # At most the read's booking (a report since, taken during the read, replaced it).
    assert b_load.sessions <= booked[0] and b_load.reserved_blocks <= booked[1], booked
    read_may_end.set()
    assert await copying == "b"
