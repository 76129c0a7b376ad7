"""The router's deadlines and races over fake replicas (no Ray, no engine): a job past its
deadline, deletes, store outages and failovers that meet each other, TTLs and held sessions,
transient replica errors and claims, and streams closed as they run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica, SlowReader, job_events
from tests.fakes.router import counted, metric
from tests.serving.routing.test_router_access import service
from tests.serving.routing.test_router_deadlines import router_over
from wim_service.serving.errors import ServiceError
from wim_service.serving.http.bodies import WiMRequest
from wim_service.serving.ingress import build_http_app
from wim_service.serving.replica.client import ReplicaLost
from wim_service.serving.routing.dispatcher import TRANSIENT_RETRIES
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import MemorySessionStore, StoredSession, StoreUnavailable
from wim_service.serving.tenants import OPEN_TENANT, ApiKeys
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions


class TransientlyDown(FakeClient):
    """Replica `down` (every replica when None) is unreachable for its next `failures` streams."""

    def __init__(self, *replicas: FakeReplica, failures: int, down: str | None = None) -> None:
        super().__init__(*replicas)
        self.failures, self.down = failures, down

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        if self.failures and self.down in (None, replica):
            self.failures -= 1
            raise ReplicaLost(replica, RuntimeError("unavailable"), transient=True)
        async for event in super().stream(replica, events):
            yield event


def test_a_job_past_its_deadline_is_stopped_with_504_and_the_fleet_fell_short() -> None:
    class Stuck(FakeClient):
        async def stream(
            self, replica: str, events: AsyncIterator[WiMEvent]
        ) -> AsyncIterator[WiMEvent]:
            await asyncio.sleep(3600)
            yield job_events()[0]

    router = WiMRouter(
        None,
        {"router": {"request_timeout_s": 0.5, "replica_wait_s": 0}},
        client=Stuck(FakeReplica("a")),
        keys=ApiKeys(None),
        http_host="127.0.0.1",
    )
    admission = router.fleet.admission
    assert admission is not None
    falls: list[None] = []
    admission.fell_short = lambda: falls.append(None)  # type: ignore[method-assign]
    client = TestClient(build_http_app(router))
    response = client.post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert response.status_code == 504 and response.json()["code"] == "deadline_exceeded"
    assert router.fleet.ledger.bindings == {}
    assert falls == [None]  # told to cheapest-first admission, as a placement with no room


def test_a_delete_during_failover_never_brings_the_session_back() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    client, router = service(a, b, keys=None)
    doc = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True  # the next query fails over and re-reads the document on b ...

    original = b.open_document

    def open_then_delete(*args: Any) -> Any:
        opened = original(*args)
        # ... and the client deletes the session while b is reading it.
        asyncio.get_event_loop().create_task(router.dispatcher.close_document(doc))
        return opened

    b.open_document = open_then_delete  # type: ignore[method-assign]
    client.post("/wim", json={"document_id": doc, "query": "q"})
    assert client.delete(f"/documents/{doc}").status_code in (204, 404)
    assert (b.documents == {} and a.documents == {}) or a.dead
    assert client.get(f"/documents/{doc}").status_code == 404
    assert asyncio.run(router.documents.get(doc)) is None


async def test_two_queries_failing_over_one_session_rebuild_it_once() -> None:
    # Reads take a while: the second query's failover starts during the first's rebuild.
    a, b = SlowReader("a", capacity=100_000), SlowReader("b")
    config = {"router": {"replica_wait_s": 0, "load_poll_interval_s": 3600}}
    router = WiMRouter(None, config, client=FakeClient(a, b), http_host="127.0.0.1")
    transport = httpx.ASGITransport(app=build_http_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        opened = await client.post("/documents", json={"context": DOCUMENT})
        document_id = opened.json()["document_id"]
        a.dead = True  # both queries find out mid-call, and both fail over
        query = {"document_id": document_id, "query": "q"}
        answers = await asyncio.gather(*(client.post("/wim", json=query) for _ in range(2)))
    if router._background is not None:
        router._background.cancel()
    assert [r.json()["replica"] for r in answers] == ["b", "b"]
    assert b.calls.count("open_document") == 1  # the second query waited for the first's


class FlakyStore(MemorySessionStore):
    """The session store, down while `down` is set (for `touch`, or `rebind`)."""

    def __init__(self) -> None:
        super().__init__()
        self.down: set[str] = set()

    async def touch(self, session_id: str, hold_s: float = 0.0) -> float | None:
        if "touch" in self.down:
            raise StoreUnavailable("redis went away")
        return await super().touch(session_id, hold_s)

    async def rebind(
        self, session_id: str, expected: str | None, new: str | None, *, promote: bool = False
    ) -> bool:
        if "rebind" in self.down:
            raise StoreUnavailable("redis went away")
        return await super().rebind(session_id, expected, new, promote=promote)


def test_a_store_outage_while_rebinding_leaves_no_kv_pinned() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    store = FlakyStore()
    router = WiMRouter(
        None,
        {"router": {"replica_wait_s": 0}},
        client=FakeClient(a, b),
        http_host="127.0.0.1",
        store=store,
    )
    client = TestClient(build_http_app(router))
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True
    store.down.add("rebind")
    response = client.post("/wim", json={"document_id": document_id, "query": "q"})
    assert response.status_code == 503 and response.json()["code"] == "unavailable"
    assert b.calls.count("open_document") == 1
    assert b.documents == {}  # the copy read on b was closed again: nobody could use it


class DeletedMeanwhile(MemorySessionStore):
    """Another router deletes the session just before this one's `touch` or `text` of it."""

    def __init__(self, before: str) -> None:
        super().__init__()
        self.before = before

    async def touch(self, session_id: str, hold_s: float = 0.0) -> float | None:
        if self.before == "touch":
            await self.delete(session_id)
        return await super().touch(session_id, hold_s)

    async def text(self, session_id: str) -> str | None:
        if self.before == "text":
            await self.delete(session_id)
        return await super().text(session_id)


@pytest.mark.parametrize("before", ["touch", "text"])
def test_a_session_deleted_by_another_router_as_its_query_starts_answers_404(
    before: str,
) -> None:
    """Deleted as the query starts (`touch`), or while its lost replica's session is being
    moved (`text`): the query answers 404 naming it, and the session is not read again."""
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    router = WiMRouter(
        None,
        {"router": {"replica_wait_s": 0}},
        client=FakeClient(a, b),
        http_host="127.0.0.1",
        store=DeletedMeanwhile(before),
    )
    client = TestClient(build_http_app(router))
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True
    asyncio.run(router.fleet.refresh_loads())
    response = client.post("/wim", json={"document_id": document_id, "query": "q"})
    assert response.status_code == 404
    assert response.json() == {
        "code": "not_found",
        "message": f"no document session {document_id!r}",
    }
    assert "open_document" not in b.calls


async def test_a_session_stays_held_until_its_last_query_ends() -> None:
    table = DocumentTable(MemorySessionStore(), hold_s=100.0, retry_after_s=1.0)
    await table.add(StoredSession("doc-held", WiMOptions(), ttl_s=5.0), DOCUMENT)

    async def expires_in() -> float:
        session = await table.get("doc-held")
        assert session is not None
        return session.expires_at - time.time()

    await table.hold("doc-held")
    assert await expires_in() > 90  # held for as long as a query may run
    await table.hold("doc-held")
    await table.release("doc-held")
    assert await expires_in() > 90  # one of two queries still runs
    await table.release("doc-held")
    assert await expires_in() < 6  # the last one ended: the TTL counts from now
    await table.renew_held()
    assert await expires_in() < 6 and "doc-held" not in table.in_use


async def test_a_store_outage_neither_leaks_a_hold_nor_fails_an_answered_query() -> None:
    store = FlakyStore()
    table = DocumentTable(store, hold_s=100.0, retry_after_s=2.0)
    await table.add(StoredSession("doc-x", WiMOptions(), ttl_s=5.0), DOCUMENT)
    await table.hold("doc-x")
    store.down.add("touch")
    await table.release("doc-x")  # the answer is out: a failed renewal is no error
    with pytest.raises(ServiceError) as refused:
        await table.hold("doc-x")
    assert (refused.value.status, refused.value.retry_after) == (503, 2.0)
    assert list(table.in_use) == []  # no query holds the session now


def test_ttl_does_not_end_a_session_in_use() -> None:
    class Slow(FakeClient):
        async def stream(
            self, replica: str, events: AsyncIterator[WiMEvent]
        ) -> AsyncIterator[WiMEvent]:
            await asyncio.sleep(1.0)  # a query running past the session's TTL
            async for event in super().stream(replica, events):
                yield event

    a = FakeReplica("a")
    router = WiMRouter(
        None,
        {"router": {"replica_wait_s": 0}},
        client=Slow(a),
        keys=ApiKeys(None),
        http_host="127.0.0.1",
    )
    client = TestClient(build_http_app(router))
    doc = client.post("/documents", json={"context": DOCUMENT, "ttl_s": 0.4}).json()
    query = {"document_id": doc["document_id"], "query": "q"}
    assert client.post("/wim", json=query).status_code == 200
    asyncio.run(router._expire_documents())
    # The TTL counts from the query's end: the session is still there, and still pinned.
    assert client.get(f"/documents/{doc['document_id']}").status_code == 200
    assert list(a.documents) == [doc["document_id"]]
    time.sleep(0.5)
    assert client.get(f"/documents/{doc['document_id']}").status_code == 404
    asyncio.run(router._expire_documents())
    assert a.documents == {}  # expired: its KV is freed


def test_a_transient_actor_error_is_retried_without_losing_the_replica() -> None:
    client, router = service(keys=None, client=TransientlyDown(FakeReplica("a"), failures=1))
    document = client.post("/documents", json={"context": DOCUMENT}).json()
    answer = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
    assert answer.status_code == 200 and answer.json()["replica"] == "a"
    assert router.fleet.ledger.is_live("a")
    assert metric(client, "wim_session_failover_total") == 0


def test_a_replica_unreachable_past_the_retries_is_failed_over() -> None:
    """TRANSIENT_RETRIES retries on the same replica, then it counts as lost."""
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    # No load poll during the test: a's load probe succeeds (only its streams fail), so a poll
    # would rightly count it live again, and the check below would race with it.
    client, router = service(
        keys=None,
        client=TransientlyDown(a, b, failures=TRANSIENT_RETRIES + 2, down="a"),
        load_poll_interval_s=3600,
    )
    answer = client.post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert answer.status_code == 200 and answer.json()["replica"] == "b"
    assert (a.calls.count("run"), b.calls.count("run")) == (TRANSIENT_RETRIES + 1, 1)
    assert not router.fleet.ledger.is_live("a")
    assert metric(client, "wim_session_binding_total", result="repin") == 1


def test_claims_name_only_the_sessions_bound_to_each_replica() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    client, router = service(a, b, keys=None)
    doc = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    asyncio.run(router._claim_documents())
    assert a.claimed == [doc] and b.claimed == []
    client.delete(f"/documents/{doc}")
    asyncio.run(router._claim_documents())
    assert a.claimed == []
    assert json.dumps(a.claimed) == "[]"


async def test_a_stream_closed_between_two_events_counts_as_cancelled() -> None:
    # A streamed answer's client that leaves as a frame is sent closes the job's events
    # between two of them (GeneratorExit), not while one is awaited (CancelledError): 499
    # either way, as the live stack's disconnect test expects.
    router = router_over(FakeReplica("a"))
    try:
        await router.fleet.refresh_loads()
        body = WiMRequest(context=DOCUMENT, query="code?", stream=True)
        _, items = await router.start_job(body, OPEN_TENANT)
        await anext(items)
        await items.aclose()  # type: ignore[attr-defined]
    finally:
        router.shutdown()
    assert counted(router, "wim_requests_total", status="499") == 1
    assert counted(router, "wim_requests_total", status="error") == 0


async def test_a_job_closed_after_its_answer_stays_answered() -> None:
    router = router_over(FakeReplica("a"))
    try:
        await router.fleet.refresh_loads()
        _, items = await router.start_job(WiMRequest(context=DOCUMENT, query="q"), OPEN_TENANT)
        async for _, event in items:
            if event.type == "done":
                break  # closed at its last event, before the stream's end
        await items.aclose()  # type: ignore[attr-defined]
    finally:
        router.shutdown()
    assert counted(router, "wim_requests_total", status="200") == 1
    assert counted(router, "wim_requests_total", status="499") == 0
