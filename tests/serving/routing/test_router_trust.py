"""Access control, tenant limits, edge limits, deadlines and races of the router, over fake
replicas (no Ray, no engine). The real-stack versions are in tests/test_serving_faults.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica, SlowReader, job_events
from tests.serving.routing.test_router_logic import metric
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.http.bodies import DocumentRequest
from wim_service.serving.http.edge import SMALL_BODY_BYTES
from wim_service.serving.ingress import build_http_app, route_edges
from wim_service.serving.replica.client import ReplicaLost
from wim_service.serving.routing.dispatcher import TRANSIENT_RETRIES
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.quotas import TenantGate
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import MemorySessionStore, StoredSession, StoreUnavailable, memory
from wim_service.serving.tenants import (
    KEYS_ENV,
    KEYS_FILE_ENV,
    OPEN_TENANT,
    ApiKeys,
    KeysConfig,
    Tenant,
    TenantLimits,
    check_open_mode,
    hash_key,
)
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions

KEYS = KeysConfig.model_validate(
    {
        "tenants": {
            "acme": {"keys": [hash_key("acme-key")], "limits": {"open_documents": 1}},
            "globex": {
                "keys": [hash_key("globex-key")],
                "limits": {"requests_per_minute": 3, "document_bytes": 2000},
                "allow": ["jobs"],
            },
        }
    }
)
ACME = {"Authorization": "Bearer acme-key"}
GLOBEX = {"Authorization": "Bearer globex-key"}


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


def service(
    *replicas: FakeReplica,
    keys: KeysConfig | None = KEYS,
    client: FakeClient | None = None,
    **router: Any,
):
    wim_router = WiMRouter(
        None,
        {"router": {"replica_wait_s": 0, "metrics_interval_s": 0, **router}},
        client=client or FakeClient(*(replicas or (FakeReplica("a"),))),
        keys=ApiKeys(keys),
        http_host="127.0.0.1",
    )
    return TestClient(build_http_app(wim_router)), wim_router


def test_requests_need_a_valid_key_and_public_endpoints_do_not() -> None:
    client, _ = service()
    body = {"context": DOCUMENT, "query": "q"}
    missing = client.post("/wim", json=body)
    assert missing.status_code == 401 and missing.json()["code"] == "unauthorized"
    wrong = client.post("/wim", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert client.post("/wim", json=body, headers=ACME).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert metric(client, "wim_requests_total", status="401") == 2


PUBLIC_ROUTES = {"/", "/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"}


def test_every_api_route_authenticates_at_the_edge_and_public_ones_take_no_body() -> None:
    """The edge's one table (`http_app.route_edges`) against the app's own routes: a route
    added without an entry would be public by default, and this names it."""
    client, _ = service()
    edge_of = route_edges(RouterConfig())
    spec = client.get("/openapi.json").json()
    seen = 0
    for template, methods in spec["paths"].items():
        path = template.replace("{document_id}", "doc-1")
        for method in methods:
            edge = edge_of(method.upper(), path)
            assert edge.authenticated == (template not in PUBLIC_ROUTES), (method, template)
            assert edge.openai == template.startswith("/v1/")
            if method != "post":
                assert edge.max_body_bytes == SMALL_BODY_BYTES, (method, template)
            seen += 1
    assert seen >= 10
    for path in PUBLIC_ROUTES:
        assert not edge_of("GET", path).authenticated


def test_the_edge_refuses_in_the_routes_own_shape() -> None:
    client, _ = service(max_body_bytes=4096)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}
    anonymous = client.post("/v1/chat/completions", json=body)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    large = client.post("/v1/chat/completions", json=body, headers=ACME)
    assert large.status_code == 413 and large.json()["error"]["code"] == "body_too_large"
    pdf = client.post("/extract/pdf", content=b"%PDF" + b"x" * 5000, headers=ACME)
    assert pdf.status_code == 413 and pdf.json()["code"] == "body_too_large"
    stray = client.request("DELETE", "/documents/doc-1", content=b"x" * 70_000, headers=ACME)
    assert stray.status_code == 413 and stray.json()["code"] == "body_too_large"


def test_a_tenant_cannot_see_query_or_delete_another_tenants_document() -> None:
    client, _ = service()
    document = client.post("/documents", json={"context": DOCUMENT}, headers=ACME).json()
    doc = document["document_id"]
    other = {"Authorization": "Bearer globex-key"}
    unknown = client.get("/documents/doc-unknown", headers=ACME)
    for response in (
        client.get(f"/documents/{doc}", headers=other),
        client.delete(f"/documents/{doc}", headers=other),
    ):
        # Indistinguishable from an unknown id (same status, code and message shape).
        assert response.status_code == unknown.status_code == 404
        assert response.json()["code"] == "not_found"
    query = client.post("/wim", json={"document_id": doc, "query": "q"}, headers=other)
    assert query.status_code in (403, 404)  # globex may not use documents at all
    assert client.get(f"/documents/{doc}", headers=ACME).status_code == 200


def test_tenant_limits_answer_429_with_retry_after_and_403_for_what_is_not_allowed() -> None:
    client, _ = service()
    assert client.post("/documents", json={"context": DOCUMENT}, headers=ACME).status_code == 201
    second = client.post("/documents", json={"context": DOCUMENT}, headers=ACME)
    assert second.status_code == 429 and second.json()["code"] == "rate_limited"
    assert int(second.headers["Retry-After"]) >= 1
    forbidden = client.post("/documents", json={"context": "x"}, headers=GLOBEX)
    assert forbidden.status_code == 403 and forbidden.json()["code"] == "forbidden"
    big = client.post("/wim", json={"context": "x" * 3000, "query": "q"}, headers=GLOBEX)
    assert big.status_code == 413 and "limit" in big.json()["message"]
    fine = client.post("/wim", json={"context": DOCUMENT, "query": "q"}, headers=GLOBEX)
    assert fine.status_code == 200
    # globex has 3 requests a minute: the three above were counted.
    limited = client.post("/wim", json={"context": "x", "query": "q"}, headers=GLOBEX)
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1


def test_concurrent_jobs_of_a_tenant_are_bounded() -> None:
    keys = KeysConfig.model_validate(
        {"tenants": {"t": {"keys": [hash_key("k")], "limits": {"concurrent_jobs": 1}}}}
    )
    slow = FakeReplica("a")
    _, router = service(slow, keys=keys)

    async def two_jobs() -> list[int]:
        tenant = router.keys.tenant("Bearer k")
        from wim_service.serving.http.bodies import WiMRequest

        first = await router.start_job(WiMRequest(context=DOCUMENT, query="q"), tenant)
        try:
            await router.start_job(WiMRequest(context=DOCUMENT, query="q"), tenant)
        except Exception as exc:  # the second one is refused while the first runs
            status = getattr(exc, "status", 0)
        else:
            status = 200
        async for _ in first[1]:
            pass
        return [status]

    assert asyncio.run(two_jobs()) == [429]


def test_open_mode_only_on_loopback_unless_opted_out() -> None:
    check_open_mode(ApiKeys(None), "127.0.0.1", {})
    check_open_mode(ApiKeys(None), "::1", {})
    check_open_mode(ApiKeys(KEYS), "0.0.0.0", {})
    with pytest.raises(RuntimeError, match="no API keys"):
        check_open_mode(ApiKeys(None), "0.0.0.0", {})
    check_open_mode(ApiKeys(None), "0.0.0.0", {"WIM_ALLOW_OPEN": "1"})
    with pytest.raises(ValueError, match="hashed"):
        KeysConfig.model_validate({"tenants": {"t": {"keys": ["plain-text-key"]}}})


def test_keys_come_from_a_mounted_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(KEYS.model_dump_json())
    # The mounted Secret wins over the variable.
    from_file = ApiKeys.from_env({KEYS_FILE_ENV: str(path), KEYS_ENV: "not json"})
    assert from_file.tenant("Bearer acme-key").name == "acme"
    from_env = ApiKeys.from_env({KEYS_ENV: KEYS.model_dump_json()})
    assert from_env.tenant("Bearer globex-key").name == "globex"
    with pytest.raises(ServiceError, match="unknown API key"):
        from_env.tenant("Bearer nope")
    assert ApiKeys.from_env({}).open and not from_env.open


def test_bodies_over_the_limit_are_refused_before_they_are_read() -> None:
    client, _ = service(keys=None, max_body_bytes=4096)
    declared = client.post(
        "/wim", content=b"{" + b" " * 8000 + b"}", headers={"content-type": "application/json"}
    )
    assert declared.status_code == 413 and declared.json()["code"] == "body_too_large"

    def chunks():
        yield b'{"context": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'", "query": "q"}'

    chunked = client.post("/wim", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["code"] == "body_too_large"
    assert "X-Request-ID" in chunked.headers


def test_a_request_id_comes_back_and_internal_errors_say_nothing_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, router = service(keys=None)
    ok = client.get("/healthz", headers={"X-Request-ID": "client-123"})
    assert ok.headers["X-Request-ID"] == "client-123"

    bug = RuntimeError("secret internals /etc/passwd")

    async def broken(*_: Any, **__: Any) -> Any:
        raise bug

    router.create_document = broken  # type: ignore[method-assign]
    with TestClient(build_http_app(router), raise_server_exceptions=False) as fresh:
        response = fresh.post("/documents", json={"context": DOCUMENT})
        assert response.status_code == 500 and response.json()["code"] == "internal_error"
        assert "secret" not in response.text and response.headers["X-Request-ID"] in response.text
        # Which router wrote the log line, as on every other answer.
        assert response.headers["X-WiM-Router"] == router.name
        named = fresh.post(
            "/documents", json={"context": DOCUMENT}, headers={"X-Request-ID": "client-456"}
        )
    assert named.headers["X-Request-ID"] == "client-456"
    assert named.json()["message"] == "internal error; the server log has request id client-456"
    # The server log has that id, with the whole exception.
    logged = [r for r in caplog.records if r.name == "wim_service.serving.http.errors"]
    assert logged[-1].levelno == logging.ERROR
    assert logged[-1].getMessage() == "request client-456 failed"
    assert logged[-1].exc_info is not None and logged[-1].exc_info[1] is bug


def test_a_job_past_its_deadline_is_stopped_with_504() -> None:
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
    client = TestClient(build_http_app(router))
    response = client.post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert response.status_code == 504 and response.json()["code"] == "deadline_exceeded"
    assert router.fleet.ledger.bindings == {}


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


def test_the_bearer_scheme_is_read_as_http_says() -> None:
    keys = ApiKeys(KEYS)
    # The scheme is case-insensitive; spaces around the key are not part of it.
    assert keys.tenant("bearer acme-key").name == "acme"
    assert keys.tenant("BEARER  acme-key ").name == "acme"
    for header in (None, "", "Bearer", "Bearer   ", "Basic acme-key", "acme-key"):
        with pytest.raises(ServiceError) as refused:
            keys.tenant(header)
        assert (refused.value.status, refused.value.message) == (
            401,
            "send your API key as 'Authorization: Bearer <key>'",
        ), header
    with pytest.raises(ServiceError) as unknown:
        keys.tenant("Bearer ACME-KEY")  # keys are compared exactly
    assert (unknown.value.status, unknown.value.message) == (401, "unknown API key")
    # Open mode: every caller is the one anonymous tenant, whatever it sends.
    assert ApiKeys(None).tenant("Bearer anything") is OPEN_TENANT


def test_open_mode_knows_loopback_by_name_and_refuses_a_public_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check_open_mode(ApiKeys(None), "localhost", {})
    check_open_mode(ApiKeys(None), "127.0.0.2", {})
    for host in ("wim.example.org", "10.0.0.5", "::"):
        with pytest.raises(RuntimeError) as refused:
            check_open_mode(ApiKeys(None), host, {})
        assert f"listens on {host!r}" in str(refused.value)
        assert all(name in str(refused.value) for name in (KEYS_FILE_ENV, KEYS_ENV))
        assert str(refused.value).endswith("=1 to run without authentication on purpose")
    with pytest.raises(RuntimeError):
        check_open_mode(ApiKeys(None), "0.0.0.0", {"WIM_ALLOW_OPEN": "true"})  # only "1"
    with caplog.at_level(logging.WARNING, logger="wim_service.serving.tenants"):
        check_open_mode(ApiKeys(None), "0.0.0.0", {"WIM_ALLOW_OPEN": "1"})
    assert [r.getMessage() for r in caplog.records] == [
        "NO AUTHENTICATION: the service listens on 0.0.0.0 without API keys because "
        "WIM_ALLOW_OPEN=1; anyone who reaches it can read and delete every document session"
    ]


async def test_the_request_rate_is_a_sliding_minute_per_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    # The memory store's clock only: the event loop keeps the real one.
    monkeypatch.setattr(memory, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    gate = TenantGate(MemorySessionStore(), RouterConfig(retry_after_s=2), frozenset())
    two = Tenant("two", TenantLimits(requests_per_minute=2))
    await gate.admit(two)  # t = 1000
    now[0] = 1010.0
    await gate.admit(two)
    now[0] = 1020.0
    with pytest.raises(ServiceError) as refused:
        await gate.admit(two)
    # Come back when the oldest request leaves the minute: 1000 + 60 - 1020.
    assert (refused.value.status, refused.value.retry_after) == (429, 40.0)
    assert refused.value.message == "more than 2 requests in a minute"
    await gate.admit(Tenant("other", TenantLimits(requests_per_minute=2)))  # its own count
    now[0] = 1059.5
    with pytest.raises(ServiceError) as soon:
        await gate.admit(two)
    assert soon.value.retry_after == 1.0  # at least a second
    now[0] = 1060.0  # the first request is exactly a minute old: out of the window
    await gate.admit(two)
    with pytest.raises(ServiceError):
        await gate.admit(two)


async def test_a_tenants_jobs_at_once_are_held_and_given_back() -> None:
    gate = TenantGate(MemorySessionStore(), RouterConfig(retry_after_s=3), frozenset())
    one = Tenant("one", TenantLimits(concurrent_jobs=1))
    async with gate.job(one):
        with pytest.raises(ServiceError) as refused:
            async with gate.job(one):
                pass
        assert (refused.value.status, refused.value.retry_after) == (429, 3)
        assert refused.value.message == "1 jobs of this tenant are running; the limit is 1"
    async with gate.job(one):  # given back
        pass


async def test_nothing_of_a_router_outlives_its_shutdown() -> None:
    """What the app's lifespan runs when Serve stops a router replica."""
    _, router = service()
    router.start()
    assert await router.ready_replicas() == ["a"]  # starts the maintenance loop
    background, monitor = router._background, router.loop_lag._task
    assert background is not None and monitor is not None
    router.shutdown()
    for _ in range(3):  # a cancelled task ends on its next turn of the loop
        await asyncio.sleep(0)
    assert background.cancelled() and monitor.cancelled()


class ReadsPastTheirCancel(FakeReplica):
    """A replica whose reads the router's cancel does not reach in time: the document is
    read (held here) before the read's answer can be awaited."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.reading = asyncio.Event()

    async def open_document(
        self, document_id: str, document: str, options: WiMOptions, *_: Any
    ) -> Any:
        self.documents[document_id] = options  # read and held, whoever awaits it
        self.reading.set()
        await asyncio.Event().wait()  # its answer never comes before the client leaves


async def test_an_abandoned_document_read_is_closed_before_its_reservation_goes_back() -> None:
    """A client gone mid-read (its request cancelled, as Serve does on a disconnect) leaves
    no session on the replica for the reaper a minute later, and the tenant's reservation is
    given back only once the replica has let go of it."""
    replica = ReadsPastTheirCancel("a")
    _, router = service(replica, client=FakeClient(replica))
    store = router.documents.store
    acme = router.keys.tenant("Bearer acme-key")
    closed_with_reservation: list[int] = []
    close = replica.close_document

    async def close_document(document_id: str) -> bool:
        held = await store.reserve(StoredSession("probe", WiMOptions(), 60, tenant="acme"), 9, 60)
        assert held is not None
        closed_with_reservation.append(held["acme"] - 1)  # acme's besides this probe
        await store.unreserve(StoredSession("probe", WiMOptions(), 60, tenant="acme"))
        return await close(document_id)

    replica.close_document = close_document  # type: ignore[method-assign]
    body = DocumentRequest(context=DOCUMENT)
    creating = asyncio.create_task(router.create_document(body, acme))
    await replica.reading.wait()
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    router.shutdown()
    assert replica.documents == {}
    assert closed_with_reservation == [1]  # still on acme's books while it was closed
    # And off them afterwards: acme (one open document at most) may open another.
    held = await store.reserve(StoredSession("next", WiMOptions(), 60, tenant="acme"), 1, 60)
    assert held == {"acme": 1}
