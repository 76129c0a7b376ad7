"""Copies in the session store, on both backends (in-process and a real redis-server): a
query's lease holds a copy against every router's retirement, idleness is judged by the last
lease any router took or gave back, and a copy is on its document's tenant's books."""

from __future__ import annotations

from dataclasses import replace

from tests.serving.store.test_session_store import TEXT, routers, session  # noqa: F401
from wim_service.serving.store import Holding, SessionStore

RETIRE_AFTER_S = 3600.0  # longer than any test: "used within the idle time"


async def test_a_leased_copy_is_not_dropped_by_another_router_until_released(
    routers: tuple[SessionStore, SessionStore],  # noqa: F811
) -> None:
    """Router `a` runs a query on the copy on r2; router `b`, which never used it, would retire
    or reclaim it: the lease in the store keeps it until `a`'s query ends."""
    a, b = routers
    hot = session(replica="r1")
    await a.create(hot, TEXT)
    assert await a.add_copy(hot.session_id, "r2", 3)
    assert await a.lease_copy(hot.session_id, "r2", "query-1", lease_s=60)
    assert not await b.drop_copy(hot.session_id, "r2", idle_s=0.0)  # a reclaim: held
    assert not await b.drop_copy(hot.session_id, "r2", idle_s=RETIRE_AFTER_S)
    # Another query's lease on it ending does not free it: query-1 still runs.
    assert await b.lease_copy(hot.session_id, "r2", "query-2", lease_s=60)
    await b.release_copy(hot.session_id, "r2", "query-2")
    assert not await b.drop_copy(hot.session_id, "r2", idle_s=0.0)
    await a.release_copy(hot.session_id, "r2", "query-1")
    # Given back just now: used within any idle time, but spare for a reclaim.
    assert not await b.drop_copy(hot.session_id, "r2", idle_s=RETIRE_AFTER_S)
    assert await b.drop_copy(hot.session_id, "r2", idle_s=0.0)
    got = await a.get(hot.session_id)
    assert got is not None and got.copies == ()


async def test_a_lease_runs_out_and_a_lost_copy_is_dropped_whatever_holds_it(
    routers: tuple[SessionStore, SessionStore],  # noqa: F811
) -> None:
    a, b = routers
    hot = session(replica="r1")
    await a.create(hot, TEXT)
    for replica in ("r2", "r3"):
        assert await a.add_copy(hot.session_id, replica, 4)
    # A lease of a router that died (never given back) stops holding the copy when it ends.
    assert await a.lease_copy(hot.session_id, "r2", "died", lease_s=0.0)
    assert await b.drop_copy(hot.session_id, "r2", idle_s=0.0)
    # A replica that is gone loses its copy at once, a query's lease or not (no `idle_s`).
    assert await a.lease_copy(hot.session_id, "r3", "running", lease_s=60)
    assert await b.drop_copy(hot.session_id, "r3")
    # A copy that is not recorded cannot be leased: the query learns it was closed.
    assert not await a.lease_copy(hot.session_id, "r3", "late", lease_s=60)
    assert not await a.lease_copy("doc-unknown", "r2", "late", lease_s=60)


async def test_listings_name_each_sessions_tenant(
    routers: tuple[SessionStore, SessionStore],  # noqa: F811
) -> None:
    a, b = routers
    mine, theirs = session(replica="r1"), session(replica="r2", tenant_name="globex")
    for new in (mine, theirs):
        await a.create(new, TEXT)
    assert await a.add_copy(mine.session_id, "r2", 3)
    listed = {h.session_id: h for h in await b.holdings()}
    assert listed[mine.session_id] == Holding(mine.session_id, "r1", ("r2",), "acme")
    assert listed[theirs.session_id] == Holding(theirs.session_id, "r2", (), "globex")


async def test_a_copy_opens_only_within_its_tenants_session_slots(
    routers: tuple[SessionStore, SessionStore],  # noqa: F811
) -> None:
    """A copy holds a session slot and the document's KV like a session: with `tenant_slots`
    the tenant's sessions and their copies stay within it. Another tenant's do not count."""
    a, b = routers
    first, second = session(replica="r1"), session(replica="r1")
    other = session(replica="r1", tenant_name="globex")
    for new in (first, second, other):
        await a.create(replace(new, kv_blocks=10), TEXT)
    assert await b.add_copy(other.session_id, "r2", 8, tenant_slots=2)
    assert await a.add_copy(first.session_id, "r2", 8, tenant_slots=3)  # acme: 2 + 1
    assert not await b.add_copy(first.session_id, "r3", 8, tenant_slots=3)
    assert not await b.add_copy(second.session_id, "r3", 8, tenant_slots=3)
    assert await b.add_copy(second.session_id, "r3", 8)  # no slot limit asked
    assert await a.drop_copy(first.session_id, "r2")
    assert await a.add_copy(first.session_id, "r3", 8, tenant_slots=5)
