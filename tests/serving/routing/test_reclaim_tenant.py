"""A one-shot `/wim` job or a plain request that finds no room reclaims spare copies for its
own tenant, as a new document session does: a tenant over its fair share gets room from its
own copies only, never from another tenant's (`TenantGate.reclaim_scope`)."""

from __future__ import annotations

import pytest

from tests.fakes.fake_service import ScriptedClient
from tests.serving.routing.test_copy_books import (
    copies_of,
    listed,
    sessions_with_copies,
    tenants_router,
)
from tests.serving.routing.test_router_copies import QUERY, TEXT
from wim_service.serving.errors import ServiceError
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.routing.router import WiMRouter
from wim_service.wim.errors import ErrorCode
from wim_service.wim.options import WiMOptions


async def full_fleet(*, kv_full: bool = False) -> WiMRouter:
    """Three replicas whose session slots (six) are all taken: acme's two sessions and their
    copies (four, over its fair share of three), globex's session and its copy; with
    `kv_full`, every replica's KV too."""
    router = await tenants_router(acme_documents=8)
    await sessions_with_copies(router, ["acme", "acme", "globex"])
    assert isinstance(router.client, ScriptedClient)
    for replica in router.client.replicas.values():
        replica.max_sessions = len(replica.documents)
        if kv_full:
            replica.reserved = replica.capacity
    await router.fleet.refresh_loads()
    await listed(router)
    return router


async def acme_copies_closed_alone(router: WiMRouter) -> bool:
    left = await copies_of(router)
    return (left["doc-acme-0"], left["doc-acme-1"], len(left["doc-globex-2"])) == ((), (), 1)


async def test_a_one_shot_job_over_its_tenants_share_reclaims_only_that_tenants_copies() -> None:
    """acme's one-shot job needs a session slot: it gets one of acme's copies', and globex
    keeps its copy."""
    router = await full_fleet()
    job = router.dispatcher.job("job-acme", QUERY, WiMOptions(), context=TEXT, tenant="acme")
    items = [item async for item in job]
    assert items[-1][1].type == "done"
    assert await acme_copies_closed_alone(router)
    router.shutdown()


async def test_a_plain_request_over_its_tenants_share_reclaims_only_that_tenants_copies() -> None:
    """With every replica's KV taken too, acme's plain request is refused (429) after a
    reclaim that closed acme's copies only."""
    router = await full_fleet(kv_full=True)
    params = PlainParams(max_tokens=2, cache_salt="tenant:acme")
    with pytest.raises(ServiceError) as refused:
        await anext(router.dispatcher.plain("plain-acme", list(range(30)), params, "acme"))
    assert refused.value.code == ErrorCode.OVERLOADED
    assert await acme_copies_closed_alone(router)
    router.shutdown()
