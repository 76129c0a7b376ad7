"""Access control, tenant limits and edge limits of the router, over fake replicas (no Ray,
no engine). Its deadlines and races are in test_router_races.py; the real-stack versions of
both in tests/live/ (test_hostile.py, test_serving.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica
from tests.fakes.router import metric
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.http.bodies import DocumentRequest
from wim_service.serving.http.edge import SMALL_BODY_BYTES
from wim_service.serving.ingress import build_http_app, route_edges
from wim_service.serving.routing.quotas import TenantGate
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import MemorySessionStore, StoredSession, memory
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
    background, monitor, probes = router._background, router.loop_lag._task, router.reach._watching
    assert background is not None and monitor is not None and probes is not None
    router.shutdown()
    for _ in range(3):  # a cancelled task ends on its next turn of the loop
        await asyncio.sleep(0)
    assert background.cancelled() and monitor.cancelled() and probes.cancelled()


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
