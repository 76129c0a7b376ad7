"""The session store's contract, on both backends: in-process and a real redis-server.

Each Redis test gets its own key prefix on the session's server; the outage tests start their
own server so that stopping it disturbs nobody else. "Two routers" are two store instances
(for Redis, two clients) over the same sessions.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.harness.redis_server import RedisServer, redis_binary
from wim_service.serving.config import StoreConfig
from wim_service.serving.store import (
    Holding,
    MemorySessionStore,
    SessionExists,
    SessionStore,
    StoredSession,
    make_store,
)
from wim_service.serving.store.cipher import ENCRYPTION_KEY_ENV, DocumentCipher
from wim_service.serving.store.redis_store import REDIS_URL_ENV, RedisSessionStore, connect
from wim_service.wim.options import WiMOptions

TEXT = "The night gate code is 4417. Ask Marta at the harbour office. " * 50
OPTIONS = WiMOptions(segment_tokens=256, answer_max_tokens=32)
ROUNDS = 50


def session(
    ttl_s: float = 60.0, replica: str | None = None, tenant_name: str = "acme"
) -> StoredSession:
    return StoredSession(
        session_id="doc-" + secrets.token_hex(8),
        options=OPTIONS,
        ttl_s=ttl_s,
        tenant=tenant_name,
        replica=replica,
        context_tokens=812,
        segments=4,
    )


def redis_config(**fields: object) -> StoreConfig:
    prefix = f"test-{secrets.token_hex(4)}:"
    return StoreConfig(backend="redis", key_prefix=prefix, **fields)  # type: ignore[arg-type]


# Short enough for expiry tests that wait it out.
CONFIG = {"expiry_grace_s": 0.3, "tombstone_ttl_s": 30.0, "timeout_s": 0.5}


@pytest.fixture(params=["memory", "redis"])
async def routers(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[SessionStore, SessionStore]]:
    """Two routers' views of one store."""
    if request.param == "memory":
        store = MemorySessionStore(tombstone_ttl_s=CONFIG["tombstone_ttl_s"])
        yield store, store
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    config = redis_config(**CONFIG)
    a, b = (RedisSessionStore(connect(server.url, config), config) for _ in range(2))
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture
def store(routers: tuple[SessionStore, SessionStore]) -> SessionStore:
    return routers[0]


# -- the contract, on both backends -------------------------------------------------------


async def test_create_get_text_and_a_second_create_fails(store: SessionStore) -> None:
    new = session(replica="r1")
    before = time.time()
    created = await store.create(new, TEXT)
    assert before + 59 < created.expires_at < time.time() + 61
    got = await store.get(new.session_id)
    assert got == created
    assert got.options == OPTIONS and got.tenant == "acme" and got.replica == "r1"
    assert (got.context_tokens, got.segments, got.ttl_s) == (812, 4, 60.0)
    assert await store.text(new.session_id) == TEXT
    with pytest.raises(SessionExists, match=new.session_id) as exists:
        await store.create(new, "another text")
    assert exists.value.session_id == new.session_id
    assert await store.text(new.session_id) == TEXT
    unknown = "doc-unknown-" + secrets.token_hex(4)
    assert await store.get(unknown) is None and await store.text(unknown) is None
    assert await store.touch(unknown) is None and not await store.rebind(unknown, None, "r1")


async def test_a_session_expires_unless_touched(store: SessionStore) -> None:
    new = session(ttl_s=0.6)
    await store.create(new, TEXT)
    await asyncio.sleep(0.4)
    renewed = await store.touch(new.session_id)
    assert renewed is not None and renewed > time.time() + 0.5
    await asyncio.sleep(0.4)  # 0.8 s after creation, 0.4 s after the touch: still live
    live = await store.get(new.session_id)
    assert live is not None and live.expires_at == pytest.approx(renewed, abs=0.01)
    await asyncio.sleep(0.5)
    assert await store.get(new.session_id) is None
    assert await store.text(new.session_id) is None
    assert await store.touch(new.session_id) is None
    assert not await store.rebind(new.session_id, None, "r1")


async def test_a_query_holds_the_session_past_its_ttl(store: SessionStore) -> None:
    new = session(ttl_s=0.3)
    await store.create(new, TEXT)
    held = await store.touch(new.session_id, hold_s=1.5)
    assert held is not None and held > time.time() + 1.2
    await asyncio.sleep(0.6)  # twice the TTL: held by the running query
    assert await store.get(new.session_id) is not None
    assert await store.sweep() == []
    # The query ended: back to the TTL from now.
    ended = await store.touch(new.session_id)
    assert ended is not None and ended < time.time() + 0.4
    await asyncio.sleep(0.5)
    assert await store.get(new.session_id) is None


async def test_holdings_list_every_live_session_for_every_router(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    bound, unbound, deleted, expiring = (
        session(replica="r1"),
        session(tenant_name="globex"),
        session(replica="r2"),
        session(ttl_s=0.2, replica="r2"),
    )
    for new in (bound, unbound, deleted, expiring):
        await a.create(new, TEXT)
    await a.delete(deleted.session_id)
    await asyncio.sleep(0.3)
    await b.add_copy(bound.session_id, "r3", 3)
    # Which replicas hold what, for which tenant, and nothing more: no options, no text.
    assert sorted(await b.holdings(), key=lambda h: h.session_id != bound.session_id) == [
        Holding(bound.session_id, "r1", ("r3",), "acme"),
        Holding(unbound.session_id, None, (), "globex"),
    ]


async def test_sweep_hands_each_expired_session_to_one_router(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    ended = [session(ttl_s=0.2, replica=f"r{i}") for i in range(3)]
    kept = session(ttl_s=60)
    for new in [*ended, kept]:
        await a.create(new, TEXT)
    await asyncio.sleep(0.4)
    swept_a, swept_b = await asyncio.gather(a.sweep(), b.sweep())
    swept = swept_a + swept_b
    assert sorted(s.session_id for s in swept) == sorted(s.session_id for s in ended)
    assert {s.replica for s in swept} == {"r0", "r1", "r2"}  # to close their KV there
    assert await a.sweep() == [] and await b.sweep() == []
    assert await b.get(kept.session_id) is not None


async def test_delete_ends_the_session_for_every_router_and_leaves_a_tombstone(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    new = session(replica="r1")
    await a.create(new, TEXT)
    deleted = await a.delete(new.session_id)
    assert deleted is not None and deleted.replica == "r1"
    assert await b.get(new.session_id) is None and await b.text(new.session_id) is None
    # Nothing brings it back: neither a router that still holds the old binding, nor a
    # re-create under the same id.
    assert not await b.rebind(new.session_id, "r1", "r2")
    assert not await b.rebind(new.session_id, None, "r2")
    with pytest.raises(SessionExists):
        await b.create(new, TEXT)
    assert await b.get(new.session_id) is None
    assert await b.delete(new.session_id) is None


async def test_delete_racing_rebind_and_create_never_resurrects(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    for _ in range(ROUNDS):
        new = session(replica="r1")
        await a.create(new, TEXT)
        results = await asyncio.gather(
            b.rebind(new.session_id, "r1", "r2"),
            a.delete(new.session_id),
            b.create(new, TEXT),
            return_exceptions=True,
        )
        assert isinstance(results[2], SessionExists)
        assert await a.get(new.session_id) is None and await b.get(new.session_id) is None
        assert await b.text(new.session_id) is None


async def test_of_two_concurrent_rebinds_exactly_one_wins(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    for _ in range(ROUNDS):
        new = session(replica="old")
        await a.create(new, TEXT)
        won_a, won_b = await asyncio.gather(
            a.rebind(new.session_id, "old", "ra"), b.rebind(new.session_id, "old", "rb")
        )
        assert won_a != won_b
        bound = await a.get(new.session_id)
        assert bound is not None and bound.replica == ("ra" if won_a else "rb")
    # Unbinding and binding an unbound session are compare-and-sets too.
    assert await a.rebind(new.session_id, bound.replica, None)
    assert (await b.get(new.session_id)).replica is None  # type: ignore[union-attr]
    assert not await b.rebind(new.session_id, "old", "rb")
    assert await b.rebind(new.session_id, None, "rb")


async def test_copies_are_recorded_within_the_limit_promoted_dropped_and_deleted(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    new = session(replica="r1")
    await a.create(replace(new, kv_blocks=40), TEXT)
    assert await a.add_copy(new.session_id, "r2", 3)
    assert not await b.add_copy(new.session_id, "r2", 3)  # it holds one already
    assert not await b.add_copy(new.session_id, "r1", 3)  # the primary is no copy
    assert await b.add_copy(new.session_id, "r3", 3)
    assert not await a.add_copy(new.session_id, "r4", 3)  # three holders: the limit
    got = await b.get(new.session_id)
    assert got is not None and got.holders == ("r1", "r2", "r3") and got.kv_blocks == 40
    assert await b.drop_copy(new.session_id, "r3")
    assert not await a.drop_copy(new.session_id, "r3") and not await a.drop_copy(
        new.session_id, "r1"
    )
    # A copy promoted to primary (its primary lost) is no longer a copy.
    assert await a.rebind(new.session_id, "r1", "r2")
    promoted = await b.get(new.session_id)
    assert promoted is not None and (promoted.replica, promoted.copies) == ("r2", ())
    assert await a.add_copy(new.session_id, "r5", 2)
    deleted = await b.delete(new.session_id)
    assert deleted is not None and deleted.holders == ("r2", "r5")  # each to be closed
    assert not await a.add_copy(new.session_id, "r6", 3)  # ended: nothing to add to


async def test_a_copy_another_router_closed_is_not_promoted(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    """Router `a` read the session with its copy on r2 and promotes it (its primary r1 lost);
    meanwhile router `b` retired that copy (dropped, then closed on r2). The promotion must
    fail: bound to r2, the session would point at a replica that no longer holds it."""
    a, b = routers
    new = session(replica="r1")
    await a.create(new, TEXT)
    assert await a.add_copy(new.session_id, "r2", 3)
    assert await b.drop_copy(new.session_id, "r2")
    assert not await a.rebind(new.session_id, "r1", "r2", promote=True)
    kept = await b.get(new.session_id)
    assert kept is not None and (kept.replica, kept.copies) == ("r1", ())
    # A copy that is still one is promoted; a rebuilt replica is bound without being one.
    assert await b.add_copy(new.session_id, "r3", 3)
    assert await a.rebind(new.session_id, "r1", "r3", promote=True)
    promoted = await b.get(new.session_id)
    assert promoted is not None and (promoted.replica, promoted.copies) == ("r3", ())
    assert await b.rebind(new.session_id, "r3", "r4")


async def test_of_two_routers_adding_a_copy_at_the_limit_one_wins(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    a, b = routers
    for _ in range(ROUNDS // 5):
        new = session(replica="r1")
        await a.create(new, TEXT)
        won = await asyncio.gather(
            a.add_copy(new.session_id, "ra", 2), b.add_copy(new.session_id, "rb", 2)
        )
        assert sorted(won) == [False, True]
        got = await a.get(new.session_id)
        assert got is not None and len(got.copies) == 1


async def test_reservations_count_against_the_tenants_limit_for_every_router(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    one, two = routers
    first, second, third = session(), session(), session(tenant_name="globex")
    assert await one.reserve(first, 2, lease_s=60) == {"acme": 1}
    assert await two.reserve(second, 2, lease_s=60) == {"acme": 2}
    assert await one.reserve(session(), 2, lease_s=60) is None  # two held: the limit
    await one.create(first, TEXT)  # the reservation becomes the session: still one each
    assert await two.reserve(third, 2, lease_s=60) == {"acme": 2, "globex": 1}
    await two.unreserve(second)
    assert await one.reserve(session(), 2, lease_s=0.3) == {"acme": 2, "globex": 1}
    await asyncio.sleep(0.4)  # an abandoned reservation runs out
    assert await two.reserve(session(), 2, lease_s=60) == {"acme": 2, "globex": 1}


async def test_a_sessions_copies_are_on_its_tenants_books_but_not_its_open_documents(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    """A copy of a hot document holds a session slot and the document's KV on another replica:
    the slots a reservation reports count it (the fair share), the tenant's open documents
    (its limit) do not: the service, not the tenant, chose to copy."""
    one, two = routers
    hot = session(replica="r1")
    assert await one.reserve(hot, 2, lease_s=60) == {"acme": 1}
    await one.create(hot, TEXT)
    assert await two.add_copy(hot.session_id, "r2", 4)
    assert await one.add_copy(hot.session_id, "r3", 4)
    assert await two.reserve(session(), 2, lease_s=60) == {"acme": 4}  # 1 + 2 copies + 1
    assert await one.reserve(session(), 2, lease_s=60) is None  # two open documents
    assert await two.drop_copy(hot.session_id, "r3")
    assert await one.reserve(session(tenant_name="globex"), 2, lease_s=60) == {
        "acme": 3,
        "globex": 1,
    }


async def test_job_leases_count_until_they_end_or_run_out(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    one, two = routers
    assert await one.start_job("acme", "j1", 2, lease_s=0.6) is None
    assert await two.start_job("acme", "j2", 2, lease_s=0.6) is None
    assert await one.start_job("acme", "j3", 2, lease_s=0.6) == 2
    assert await one.start_job("globex", "j3", 2, lease_s=0.6) is None  # its own count
    await two.end_job("acme", "j2")
    for _ in range(3):  # j1 renewed past its first lease; j2 ended stays ended
        await asyncio.sleep(0.3)
        await one.renew_jobs([("acme", "j1"), ("acme", "j2")], lease_s=0.6)
    assert await two.start_job("acme", "j4", 2, lease_s=0.6) is None
    assert await two.start_job("acme", "j5", 2, lease_s=0.6) == 2
    await asyncio.sleep(0.7)  # nobody renews: every lease runs out
    assert await one.start_job("acme", "j6", 1, lease_s=0.6) is None


async def test_the_request_window_slides_for_every_router(
    routers: tuple[SessionStore, SessionStore],
) -> None:
    one, two = routers
    assert await one.admit_request("acme", 2, window_s=0.5) is None
    await asyncio.sleep(0.2)
    assert await two.admit_request("acme", 2, window_s=0.5) is None
    wait_s = await one.admit_request("acme", 2, window_s=0.5)
    assert wait_s is not None and 0.1 < wait_s <= 0.3  # until the first leaves the window
    assert await two.admit_request("globex", 2, window_s=0.5) is None
    await asyncio.sleep(wait_s + 0.05)
    assert await two.admit_request("acme", 2, window_s=0.5) is None


async def test_memory_store_ends_sessions_and_tombstones_at_their_instant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a frozen clock: at its expiry instant a session is gone for every method at once and
    swept; a tombstone blocks a create until its instant and no longer."""
    now = [1_000_000.0]
    monkeypatch.setattr("wim_service.serving.store.memory.time.time", lambda: now[0])
    store = MemorySessionStore(tombstone_ttl_s=30.0)
    ending, deleted = session(ttl_s=10.0), session()
    await store.create(ending, TEXT)
    await store.create(deleted, TEXT)
    await store.delete(deleted.session_id)
    now[0] += 10.0
    assert await store.get(ending.session_id) is None and await store.holdings() == []
    assert [s.session_id for s in await store.sweep()] == [ending.session_id]
    now[0] += 19.0
    with pytest.raises(SessionExists):
        await store.create(deleted, TEXT)
    now[0] += 1.0  # the tombstone ends
    created = await store.create(deleted, TEXT)
    assert created.expires_at == now[0] + deleted.ttl_s


# -- Redis only --------------------------------------------------------------------------


# -- configuration ------------------------------------------------------------------------


def test_make_store_picks_the_backend_and_takes_secrets_only_from_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert isinstance(make_store(StoreConfig()), MemorySessionStore)
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(ValueError, match=REDIS_URL_ENV):
        make_store(StoreConfig(backend="redis"))
    with pytest.raises(ValueError, match="extra"):
        StoreConfig.model_validate({"backend": "redis", "url": "redis://127.0.0.1:6379/0"})
    monkeypatch.setenv(REDIS_URL_ENV, "redis://127.0.0.1:1/0")
    monkeypatch.setenv(ENCRYPTION_KEY_ENV, base64.b64encode(b"k" * 32).decode())
    store = make_store(StoreConfig(backend="redis"))
    assert isinstance(store, RedisSessionStore)
    assert b"secret" not in store.cipher.seal("doc-1", "secret")
    monkeypatch.setenv(ENCRYPTION_KEY_ENV, base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="32 bytes"):
        make_store(StoreConfig(backend="redis"))


def test_the_document_key_comes_from_env_and_must_be_strict_base64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for unset in (None, "  "):
        if unset is None:
            monkeypatch.delenv(ENCRYPTION_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(ENCRYPTION_KEY_ENV, unset)
        plain = DocumentCipher.from_env()
        assert b"secret" in plain.seal("doc-1", "secret")  # no key: stored as it is
    key = base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv(ENCRYPTION_KEY_ENV, f" {key}\n")  # as a mounted Secret may end
    sealed = DocumentCipher.from_env().seal("doc-1", "secret")
    assert b"secret" not in sealed
    # A stray character is refused, not dropped (a lenient decode reads another key).
    monkeypatch.setenv(ENCRYPTION_KEY_ENV, key[:8] + "!" + key[8:])
    with pytest.raises(ValueError, match="must be base64"):
        DocumentCipher.from_env()
    # Read without the key, an encrypted text names the setting that is missing.
    with pytest.raises(ValueError, match=ENCRYPTION_KEY_ENV):
        plain.open("doc-1", sealed)


CHILD_WITH_A_SERVER = """
import pathlib, sys, tempfile, time
from tests.harness.redis_server import RedisServer
server = RedisServer(sys.argv[1], pathlib.Path(tempfile.mkdtemp())).start()
print(server.process.pid, flush=True)
time.sleep(120)
"""


def test_a_redis_server_ends_with_the_process_that_started_it() -> None:
    """SIGKILL leaves no fixture teardown to run: the kernel ends the server (setpriv
    --pdeathsig), so a killed test run leaves no redis-server behind."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_WITH_A_SERVER, redis_binary()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert child.stdout is not None
    server = psutil.Process(int(child.stdout.readline()))
    assert "redis-server" in " ".join(server.cmdline())
    child.kill()
    child.wait()
    gone, alive = psutil.wait_procs([server], timeout=10)
    assert gone and not alive
