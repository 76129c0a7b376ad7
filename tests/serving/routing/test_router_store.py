"""Several routers over one session store, over fake replicas (no Ray, no engine): any router
serves any document session, a DELETE through one is seen by all, a restarted router loses no
session, two routers never bind a session to two replicas, and a store outage answers 503
without leaving KV pinned on a replica.

Each test runs on both backends (one in-process store shared by the routers, and a real
redis-server with one client per router); the outage tests need Redis. Requests go through the
real HTTP app in the test's event loop (httpx over ASGI), so that routers run concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica
from tests.harness.redis_server import RedisServer, redis_binary
from tests.serving.routing.test_router_access import ACME, KEYS
from wim_service.engine.config import EngineConfig
from wim_service.serving.config import StoreConfig
from wim_service.serving.ingress import build_http_app
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.routing.sizing import JobSizer
from wim_service.serving.store import MemorySessionStore, SessionStore
from wim_service.serving.store.redis_store import RedisSessionStore, connect
from wim_service.serving.tenants import ApiKeys, KeysConfig

ROUNDS = 10
# The maintenance loop runs once when a router starts; tests drive expiry and claims.
ROUTER = {"replica_wait_s": 0, "load_poll_interval_s": 3600}
SIZER = JobSizer(EngineConfig())


class Routers:
    """Makes routers over the same fake replicas and one shared store; cleans them up."""

    def __init__(self, store_factory: Callable[[], SessionStore], stack: AsyncExitStack) -> None:
        self.store_factory = store_factory
        self.stack = stack

    async def new(
        self,
        *replicas: FakeReplica,
        keys: KeysConfig | None = None,
        client: FakeClient | None = None,
        **router: Any,
    ) -> tuple[httpx.AsyncClient, WiMRouter]:
        """A router over `replicas` (or `client`), with `router` config on top of `ROUTER`."""
        wim_router = WiMRouter(
            None,
            {"router": {**ROUTER, **router}},
            client=client or FakeClient(*replicas),
            keys=ApiKeys(keys),
            http_host="127.0.0.1",
            store=self.store_factory(),
        )
        # One tokenizer for every router of the tests: loading one takes seconds.
        wim_router.dispatcher.sizer = SIZER
        self.stack.push_async_callback(_stop, wim_router)
        transport = httpx.ASGITransport(app=build_http_app(wim_router))
        client = httpx.AsyncClient(transport=transport, base_url="http://router")
        await self.stack.enter_async_context(client)
        return client, wim_router


async def _stop(router: WiMRouter) -> None:
    if router._background is not None:
        router._background.cancel()
    await router.documents.store.close()


def on_redis(server: RedisServer, stack: AsyncExitStack) -> Routers:
    """Routers with a Redis client each on `server`, under a key prefix of their own."""
    config = StoreConfig(backend="redis", key_prefix=f"test-{secrets.token_hex(4)}:")
    return Routers(lambda: RedisSessionStore(connect(server.url, config), config), stack)


@pytest.fixture(params=["memory", "redis"])
async def routers(request: pytest.FixtureRequest) -> AsyncIterator[Routers]:
    async with AsyncExitStack() as stack:
        if request.param == "memory":
            shared = MemorySessionStore()
            yield Routers(lambda: shared, stack)
        else:
            yield on_redis(request.getfixturevalue("redis_server"), stack)


def replicas_of(*replicas: FakeReplica, document_id: str) -> list[str]:
    return [r.name for r in replicas if document_id in r.documents]


async def open_document(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/documents", json={"context": DOCUMENT, **body})
    assert response.status_code == 201, response.text
    return response.json()


def reports_full(router: WiMRouter, replica: str) -> None:
    """`replica` reports its KV committed to `router` (and to it alone)."""
    ledger = router.fleet.ledger
    load = ledger.load(replica)
    assert load is not None
    ledger.take_reports(ledger.live, [dataclasses.replace(load, reserved_blocks=5_000)])


async def query(client: httpx.AsyncClient, document_id: str) -> httpx.Response:
    return await client.post("/wim", json={"document_id": document_id, "query": "code?"})


async def test_a_document_opened_through_one_router_is_served_by_another(
    routers: Routers,
) -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    first, _ = await routers.new(a, b)
    second, _ = await routers.new(a, b)
    document = await open_document(first)
    assert document["replica"] == "a"
    answer = await query(second, document["document_id"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["replica"] == "a" and answer.json()["answer"] == "The code is 4417."
    # Queried from the KV pinned on a: read once, never again.
    assert a.calls.count("open_document") == 1 and "open_document" not in b.calls
    seen = (await second.get(f"/documents/{document['document_id']}")).json()
    assert {**seen, "expires_at": 0} == {**document, "expires_at": 0}


async def test_a_delete_through_one_router_is_seen_by_every_router_at_once(
    routers: Routers,
) -> None:
    a = FakeReplica("a")
    first, _ = await routers.new(a)
    second, _ = await routers.new(a)
    document_id = (await open_document(first))["document_id"]
    assert (await query(second, document_id)).status_code == 200
    assert (await first.delete(f"/documents/{document_id}")).status_code == 204
    assert a.documents == {}
    gone = await query(second, document_id)
    assert gone.status_code == 404 and gone.json()["code"] == "not_found"
    assert (await second.get(f"/documents/{document_id}")).status_code == 404
    assert (await second.delete(f"/documents/{document_id}")).status_code == 404


async def test_a_restarted_router_keeps_every_session(routers: Routers) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    before, _ = await routers.new(a, b)
    documents = [await open_document(before) for _ in range(4)]
    assert {d["replica"] for d in documents} == {"a", "b"}
    after, restarted = await routers.new(a, b)  # a new instance: nothing in its memory
    for document in documents:
        answer = await query(after, document["document_id"])
        assert answer.status_code == 200 and answer.json()["replica"] == document["replica"]
    assert a.calls.count("open_document") + b.calls.count("open_document") == 4
    # It claims every session for its replica, so that none is reaped as an orphan.
    await restarted._claim_documents()
    for replica in (a, b):
        assert sorted(replica.claimed) == sorted(
            d["document_id"] for d in documents if d["replica"] == replica.name
        )


async def test_two_routers_failing_over_one_session_bind_it_to_one_replica(
    routers: Routers,
) -> None:
    a = FakeReplica("a", capacity=100_000)
    b, c = FakeReplica("b"), FakeReplica("c")
    first, one = await routers.new(a, b, c)
    second, two = await routers.new(a, b, c)
    for _ in range(ROUNDS):
        a.dead = False
        await one.fleet.refresh_loads()
        await two.fleet.refresh_loads()
        document_id = (await open_document(first))["document_id"]
        a.dead = True
        # Each router would rebuild it on a different replica.
        reports_full(one, "b")
        reports_full(two, "c")
        answers = await asyncio.gather(query(first, document_id), query(second, document_id))
        bound = (await second.get(f"/documents/{document_id}")).json()["replica"]
        assert bound in ("b", "c")
        assert [r.status_code for r in answers] == [200, 200]
        assert {r.json()["replica"] for r in answers} == {bound}
        # The router that lost the race closed its copy: the KV is pinned once.
        assert replicas_of(b, c, document_id=document_id) == [bound]
        assert (await first.delete(f"/documents/{document_id}")).status_code == 204
        assert replicas_of(b, c, document_id=document_id) == []
        a.documents.clear()  # its copy went with it


async def test_a_session_expires_once_for_every_router(routers: Routers) -> None:
    a = FakeReplica("a")
    first, one = await routers.new(a)
    second, two = await routers.new(a)
    document_id = (await open_document(first, ttl_s=0.3))["document_id"]
    await asyncio.sleep(0.5)
    assert (await query(second, document_id)).status_code == 404
    await asyncio.gather(one._expire_documents(), two._expire_documents())
    assert a.documents == {}  # closed by whichever router swept it
    assert a.calls.count("close_document") == 1


async def test_a_tenants_open_document_limit_counts_its_sessions_on_every_router(
    routers: Routers,
) -> None:
    a = FakeReplica("a")
    first, _ = await routers.new(a, keys=KEYS)
    second, _ = await routers.new(a, keys=KEYS)
    body = {"context": DOCUMENT}
    opened = await first.post("/documents", json=body, headers=ACME)  # acme may hold one
    assert opened.status_code == 201
    refused = await second.post("/documents", json=body, headers=ACME)
    assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"
    deleted = await second.delete(f"/documents/{opened.json()['document_id']}", headers=ACME)
    assert deleted.status_code == 204
    assert (await first.post("/documents", json=body, headers=ACME)).status_code == 201


# -- the store unavailable (Redis only) ---------------------------------------------------


@pytest.fixture
async def outage(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, Routers]]:
    """Routers on their own redis-server, which the test may stop."""
    server = RedisServer(redis_binary(), tmp_path).start()
    config = StoreConfig(backend="redis", timeout_s=0.5, connect_timeout_s=0.5, outage_wait_s=0)
    async with AsyncExitStack() as stack:
        stack.callback(server.stop)
        yield server, Routers(lambda: RedisSessionStore(connect(server.url, config), config), stack)


def unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["code"] == "unavailable" and int(response.headers["Retry-After"]) >= 1


async def test_redis_down_answers_503_with_retry_after_and_recovers(
    outage: tuple[RedisServer, Routers],
) -> None:
    server, routers = outage
    a = FakeReplica("a")
    client, _ = await routers.new(a)
    document_id = (await open_document(client))["document_id"]
    server.stop()
    unavailable(await client.post("/documents", json={"context": DOCUMENT}))
    unavailable(await query(client, document_id))
    unavailable(await client.get(f"/documents/{document_id}"))
    unavailable(await client.delete(f"/documents/{document_id}"))
    assert list(a.documents) == [document_id]  # nothing opened, nothing closed meanwhile
    server.start()  # persistence is off: the sessions are gone, the service works again
    assert (await query(client, document_id)).status_code == 404
    again = await open_document(client)
    assert (await query(client, again["document_id"])).status_code == 200


async def test_a_store_outage_while_reading_leaves_no_kv_pinned(
    outage: tuple[RedisServer, Routers],
) -> None:
    server, routers = outage
    a = FakeReplica("a")
    client, _ = await routers.new(a)
    original = a.open_document

    def open_then_lose_the_store(*args: Any) -> Any:
        opened = original(*args)
        server.stop()  # the document is read, but its session cannot be stored
        return opened

    a.open_document = open_then_lose_the_store  # type: ignore[method-assign]
    unavailable(await client.post("/documents", json={"context": DOCUMENT}))
    assert a.documents == {}  # the copy just read was closed again
    assert a.calls.count("close_document") == 1


async def test_a_router_keeps_claiming_its_sessions_while_the_store_is_down(
    outage: tuple[RedisServer, Routers],
) -> None:
    """Replicas reap the sessions no router claims; a store outage must not make every
    session an orphan (the rule is for a router that is gone)."""
    server, routers = outage
    a = FakeReplica("a")
    client, _ = await routers.new(a, load_poll_interval_s=0.05)  # the maintenance loop runs
    document_id = (await open_document(client))["document_id"]

    async def claimed(ids: list[str]) -> None:
        a.claimed = None
        while a.claimed != ids:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(claimed([document_id]), 10)
    server.stop()
    # Expiry, renewals and the listing all fail now; the claims of the last listing go on.
    await asyncio.wait_for(claimed([document_id]), 10)
    assert list(a.documents) == [document_id]
    server.start()  # empty (no persistence): the session is gone, and no longer claimed
    await asyncio.wait_for(claimed([]), 10)
