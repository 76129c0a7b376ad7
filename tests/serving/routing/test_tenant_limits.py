"""Tenant limits across routers, and the fair share of session slots (`serving/routing/quotas.py`).

Two routers over the same fake replicas share one real redis-server (a client each); requests
go through the real HTTP app in the test's event loop (httpx over ASGI), so that the routers
run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import httpx
import pytest

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica, SlowReader
from tests.harness.redis_server import RedisServer
from tests.serving.routing.test_router_store import Routers, on_redis
from wim_service.serving.replica.contracts import ReplicaLoad
from wim_service.serving.routing.quotas import over_fair_share
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store.redis_store import RedisSessionStore
from wim_service.serving.tenants import ApiKeys, KeysConfig, hash_key
from wim_service.wim.events import WiMEvent

JOB = {"context": DOCUMENT, "query": "code?"}


def tenants(**limits: dict[str, int]) -> KeysConfig:
    """Tenant `name` with key `name-key` and these limits, for each keyword."""
    return KeysConfig.model_validate(
        {
            "tenants": {
                name: {"keys": [hash_key(f"{name}-key")], "limits": tenant_limits}
                for name, tenant_limits in limits.items()
            }
        }
    )


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-key"}


def refused(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["code"] == "rate_limited" and int(response.headers["Retry-After"]) >= 1


class HeldJobs(FakeClient):
    """Jobs stream only once `go` is set; `started` is set when one begins (its tenant's job is
    counted by then)."""

    def __init__(self, *replicas: FakeReplica) -> None:
        super().__init__(*replicas)
        self.started, self.go = asyncio.Event(), asyncio.Event()

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        self.started.set()
        await self.go.wait()
        async for event in super().stream(replica, events):
            yield event


class FourSlots(FakeReplica):
    """A replica that admits four sessions at once."""

    async def load(self) -> ReplicaLoad:
        return (await super().load()).model_copy(update={"max_sessions": 4})


@pytest.fixture
async def routers(redis_server: RedisServer) -> AsyncIterator[Routers]:
    async with AsyncExitStack() as stack:
        yield on_redis(redis_server, stack)


async def test_a_tenants_request_rate_is_counted_across_routers(routers: Routers) -> None:
    a = FakeReplica("a")
    keys = tenants(acme={"requests_per_minute": 3})
    first, _ = await routers.new(a, keys=keys)
    second, _ = await routers.new(a, keys=keys)
    for client in (first, second, first):
        assert (await client.post("/wim", json=JOB, headers=key("acme"))).status_code == 200
    refused(await second.post("/wim", json=JOB, headers=key("acme")))
    refused(await first.post("/wim", json=JOB, headers=key("acme")))


async def test_a_tenants_concurrent_jobs_are_counted_across_routers(routers: Routers) -> None:
    a = FakeReplica("a")
    keys = tenants(acme={"concurrent_jobs": 1})
    held = HeldJobs(a)
    first, _ = await routers.new(keys=keys, client=held)
    second, _ = await routers.new(a, keys=keys)
    running = asyncio.create_task(first.post("/wim", json=JOB, headers=key("acme")))
    await held.started.wait()
    refused(await second.post("/wim", json=JOB, headers=key("acme")))
    held.go.set()
    assert (await running).status_code == 200
    assert (await second.post("/wim", json=JOB, headers=key("acme"))).status_code == 200


async def job_lease(router: WiMRouter) -> tuple[float | None, float]:
    """The lease end of `router`'s one running job (None once it ran out and was dropped) and
    the time now, both by Redis' clock (the store's, which judges leases), in ms."""
    store = router.gate.store
    assert isinstance(store, RedisSessionStore)
    ((tenant, job_id),) = router.gate._jobs
    end = await store.client.zscore(store._tenant_key(tenant, "jobs"), job_id)
    seconds, micros = await store.client.time()
    return end, seconds * 1000 + micros / 1000


async def until_lease(
    router: WiMRouter, what: str, ready: Callable[[float | None, float], bool]
) -> None:
    """Wait until `ready(lease end, now)` holds, asking the store: the lease's clock is Redis',
    so the test waits on what the store says, not for a time of its own."""
    for _ in range(600):  # a bound, so that a lease that never changes fails, not hangs
        if ready(*await job_lease(router)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the job's lease was never {what}: {await job_lease(router)}")


async def test_the_jobs_of_a_router_that_died_stop_counting_after_their_lease(
    routers: Routers,
) -> None:
    a = FakeReplica("a")
    keys = tenants(acme={"concurrent_jobs": 1})
    held = HeldJobs(a)
    # Renewed every second: a renewal up to two seconds late (a busy machine) still finds it
    # running.
    lease_ms = 3000.0
    lease = {"job_lease_s": lease_ms / 1000}
    first, dying = await routers.new(keys=keys, client=held, **lease)
    second, _ = await routers.new(a, keys=keys, **lease)
    running = asyncio.create_task(first.post("/wim", json=JOB, headers=key("acme")))
    await held.started.wait()
    first_end, _ = await job_lease(dying)
    assert first_end is not None
    # Renewed while its router lives: a renewal made after its first lease ended (Redis
    # renews only a lease still running), so it counted all along.
    renewed = "renewed past its first end"
    await until_lease(dying, renewed, lambda end, _: end is not None and end - lease_ms > first_end)
    refused(await second.post("/wim", json=JOB, headers=key("acme")))
    # The router dies: it renews nothing and never ends its job.
    renewing = dying.gate._renewing
    assert renewing is not None
    renewing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await renewing
    await until_lease(dying, "over", lambda end, now: end is None or end <= now)
    assert (await second.post("/wim", json=JOB, headers=key("acme"))).status_code == 200
    running.cancel()


async def test_two_concurrent_creates_on_two_routers_pass_an_open_documents_limit_once(
    routers: Routers,
) -> None:
    a = SlowReader("a", read_s=0.2)  # reading takes a while: the two creates overlap
    keys = tenants(acme={"open_documents": 1})
    slow = FakeClient(a)
    first, _ = await routers.new(keys=keys, client=slow)
    second, _ = await routers.new(keys=keys, client=slow)
    body = {"context": DOCUMENT}
    answers = await asyncio.gather(
        first.post("/documents", json=body, headers=key("acme")),
        second.post("/documents", json=body, headers=key("acme")),
    )
    assert sorted(r.status_code for r in answers) == [201, 429]
    refused(next(r for r in answers if r.status_code == 429))
    assert len(a.documents) == 1  # the refused create read nothing


@pytest.mark.parametrize(
    ("asker", "held", "capacity", "share"),
    [
        # Not nearly full (more than a quarter of the slots free): only the tenant's limit.
        ("a", {"a": 5}, 8, None),
        # Nearly full: a's share is 8 // 2 (a, and b or c who may come); it holds 6.
        ("a", {"a": 6}, 8, 4),
        # b asks: under its share of 8 // 3 (a, b, and c who may come), it gets a last slot.
        ("b", {"a": 6}, 8, None),
        ("b", {"a": 6, "b": 1}, 8, None),
        # Full: b at its share is refused too (not left to a 503 from placement).
        ("b", {"a": 4, "b": 4}, 8, 2),
        # All three hold, nobody else may come: 8 // 3 = 2 each.
        ("c", {"a": 3, "b": 2, "c": 2}, 8, 2),
        ("c", {"a": 3, "b": 2, "c": 1}, 8, None),
        # More tenants than slots: a share is at least 1.
        ("a", {"a": 1, "b": 1, "c": 1}, 3, 1),
        # No replica up: placement answers (503), not the fair share.
        ("a", {"a": 2}, 0, None),
    ],
)
def test_the_fair_share_is_refused_only_when_the_fleet_is_nearly_full(
    asker: str, held: dict[str, int], capacity: int, share: int | None
) -> None:
    everyone = frozenset("abc")
    assert over_fair_share(asker, held, capacity, tenants=everyone, headroom=0.25) == share


def test_a_lone_tenant_may_fill_every_slot() -> None:
    """With no other tenant that could ask (open mode, or one configured), nobody is owed."""
    assert over_fair_share("", {"": 7}, 8, tenants=frozenset(), headroom=0.25) is None
    assert over_fair_share("a", {"a": 7}, 8, tenants=frozenset("a"), headroom=0.25) is None
    assert over_fair_share("a", {"a": 8}, 8, tenants=frozenset("a"), headroom=0.25) is None


async def test_a_tenant_filling_the_fleet_leaves_a_session_for_another(routers: Routers) -> None:
    replicas = FourSlots("a", capacity=100_000), FourSlots("b", capacity=100_000)
    keys = tenants(acme={}, globex={})
    first, _ = await routers.new(*replicas, keys=keys)
    second, _ = await routers.new(*replicas, keys=keys)
    body = {"context": DOCUMENT}
    answers = [await first.post("/documents", json=body, headers=key("acme")) for _ in range(7)]
    # 8 slots, 2 of them kept: acme holds 6, more than its fair share of 8 / 2.
    assert [a.status_code for a in answers] == [201] * 6 + [429]
    refused(answers[-1])
    assert (
        "this tenant holds 6 of them, at least its fair share of 4" in answers[-1].json()["message"]
    )
    assert (await second.post("/documents", json=body, headers=key("globex"))).status_code == 201
    refused(await second.post("/documents", json=body, headers=key("acme")))


def test_a_tenant_allowed_no_documents_takes_no_fair_share() -> None:
    """As on the real stack: a tenant with `open_documents` 0 (beta) or allowed only jobs can
    never hold a session, so it does not shrink the others' share (there alpha, alone, fills
    the fleet and gets 429 `overloaded`, not `rate_limited`)."""
    keys = ApiKeys(tenants(alpha={"open_documents": 16}, beta={"open_documents": 0}, gamma={}))
    assert keys.document_tenants == frozenset({"alpha", "gamma"})
    jobs_only = KeysConfig.model_validate(
        {"tenants": {"gamma": {"keys": [hash_key("g")], "allow": ["jobs"]}}}
    )
    assert ApiKeys(jobs_only).document_tenants == frozenset()
