"""Copies across routers and on the tenants' books, over scripted fake replicas: a query on a
copy holds a lease in the shared session store, so another router neither retires nor
reclaims that copy; a copy opens only within its tenant's session slots; and a reclaim asked
for a tenant over its fair share closes that tenant's own copies, never another tenant's."""

from __future__ import annotations

import pytest

from tests.fakes.fake_service import ScriptedClient, ScriptedReplica
from tests.serving.routing.test_router_copies import QUERY, TEXT
from tests.serving.routing.test_router_store import Routers, open_document, routers  # noqa: F401
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoredSession
from wim_service.serving.tenants import (
    ApiKeys,
    KeysConfig,
    TenantConfig,
    TenantLimits,
    hash_key,
)
from wim_service.wim.options import WiMOptions


@pytest.mark.parametrize("routers", ["memory", "redis"], indirect=True)
async def test_a_copy_one_router_reads_is_not_reclaimed_by_another(
    routers: Routers,  # noqa: F811
) -> None:
    """Router `one` runs a query on the copy on b. Router `two` never used that copy: by its
    own queries it is spare, and two's reclaim (no room for its work) would close it under
    one's running query. The query's lease in the store keeps it until the query ends."""
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    client = ScriptedClient(a, b, delay_s=0.005)
    first, one = await routers.new(client=client)
    _, two = await routers.new(client=client)
    document_id = (await open_document(first, context=TEXT))["document_id"]
    session = await one.documents.get(document_id)
    assert session is not None and session.replica == "a"
    assert await one.dispatcher.copies._open(session, "b")
    a.backlog_s = 30.0  # a is busy: the next query goes to the copy
    await one.fleet.refresh_loads()
    record = await one.documents.get(document_id)
    running = one.dispatcher.job(document_id, QUERY, WiMOptions(), record=record)
    assert (await anext(running))[0] == "b"
    await two.dispatcher.copies.retire_idle(await two.documents.holdings())
    assert await two.dispatcher.copies.reclaim() == 0
    assert document_id in b.documents
    items = [item async for item in running]
    assert items[-1][1].type == "done" and {replica for replica, _ in items} == {"b"}
    # The query ended: the copy is spare now, for any router's reclaim.
    assert await two.dispatcher.copies.reclaim() == 1
    assert b.documents == {} and document_id in a.documents
    stored = await one.documents.get(document_id)
    assert stored is not None and stored.copies == ()


async def tenants_router(acme_documents: int, max_sessions: int = 1 << 30) -> WiMRouter:
    """A router of tenants acme (`acme_documents` open documents) and globex over replicas a,
    b and c of `max_sessions` session slots each."""
    keys = KeysConfig(
        tenants={
            "acme": TenantConfig(
                keys=[hash_key("acme-key")],
                limits=TenantLimits(open_documents=acme_documents),
            ),
            "globex": TenantConfig(keys=[hash_key("globex-key")]),
        }
    )
    replicas = [ScriptedReplica(name) for name in ("a", "b", "c")]
    for replica in replicas:
        replica.max_sessions = max_sessions
    router = WiMRouter(
        None,
        {"router": {"replica_wait_s": 0, "load_poll_interval_s": 3600, "copy_idle_s": 600}},
        client=ScriptedClient(*replicas, delay_s=0.005),
        keys=ApiKeys(keys),
        http_host="127.0.0.1",
    )
    await router.fleet.refresh_loads()
    return router


async def sessions_with_copies(router: WiMRouter, owners: list[str]) -> list[StoredSession]:
    """A session of each of `owners`, each read on one replica with a copy on another."""
    opened = []
    for i, tenant in enumerate(owners):
        new = StoredSession(f"doc-{tenant}-{i}", WiMOptions(), ttl_s=600.0, tenant=tenant)
        session = await router.dispatcher.open_document(new, TEXT)
        elsewhere = next(r for r in ("a", "b", "c") if r != session.replica)
        assert await router.dispatcher.copies._open(session, elsewhere)
        opened.append(session)
    return opened


async def listed(router: WiMRouter) -> None:
    """The router's maintenance as of now: the store listed, whose copies are whose (no copy
    idle for `copy_idle_s`)."""
    await router._claim_documents()
    await router._retire_copies()


async def copies_of(router: WiMRouter) -> dict[str, tuple[str, ...]]:
    return {h.session_id: h.copies for h in await router.documents.holdings()}


async def test_a_reclaim_for_a_tenant_over_its_share_leaves_other_tenants_copies() -> None:
    """Three replicas of two session slots: acme's two sessions and their copies hold four of
    the six, globex's one and its copy two. acme is over its fair share (3): room for its work
    comes from its own copies only. globex, under its share, may take any spare copy."""
    router = await tenants_router(acme_documents=8, max_sessions=2)
    await sessions_with_copies(router, ["acme", "acme", "globex"])
    await router.fleet.refresh_loads()
    await listed(router)
    assert await router.dispatcher.copies.reclaim("acme") == 2
    left = await copies_of(router)
    assert (left["doc-acme-0"], left["doc-acme-1"], len(left["doc-globex-2"])) == ((), (), 1)
    await listed(router)
    assert await router.dispatcher.copies.reclaim("globex") == 1
    assert set((await copies_of(router)).values()) == {()}
    router.shutdown()


async def test_a_copy_opens_only_within_its_tenants_session_slots() -> None:
    """acme may hold 3 session slots: its two sessions and one copy. A second copy would put
    its document's KV and slot past them; globex's session and copy do not count for acme."""
    router = await tenants_router(acme_documents=3)
    await sessions_with_copies(router, ["acme", "globex"])
    third = StoredSession("doc-acme-2", WiMOptions(), ttl_s=600.0, tenant="acme")
    third = await router.dispatcher.open_document(third, TEXT)
    elsewhere = next(r for r in ("a", "b", "c") if r != third.replica)
    assert not await router.dispatcher.copies._open(third, elsewhere)
    copies = await copies_of(router)
    assert (len(copies["doc-acme-0"]), len(copies["doc-globex-1"]), copies[third.session_id]) == (
        1,
        1,
        (),
    )
    router.shutdown()
