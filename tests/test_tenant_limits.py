"""Tenant limits across routers (`serving/quotas.py`).

Two routers over the same fake replicas share one real redis-server (a client each); requests
go through the real HTTP app in the test's event loop (httpx over ASGI), so that the routers
run concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from tests.redis_server import RedisServer
from tests.test_router_logic import DOCUMENT, FakeClient, FakeReplica
from tests.test_router_store import Routers, on_redis
from wim_service.serving.auth import KeysConfig, hash_key
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

    async def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
        self.started.set()
        await self.go.wait()
        async for event in super().stream(replica, method, *args):
            yield event


class SlowReads(FakeClient):
    """Reading a document takes a while: two creates overlap."""

    async def call(self, replica: str, method: str, *args: Any) -> Any:
        if method == "open_document":
            await asyncio.sleep(0.2)
        return await super().call(replica, method, *args)


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


async def test_the_jobs_of_a_router_that_died_stop_counting_after_their_lease(
    routers: Routers,
) -> None:
    a = FakeReplica("a")
    keys = tenants(acme={"concurrent_jobs": 1})
    held = HeldJobs(a)
    # Renewed every 0.7 s: a renewal that fails on a busy machine (a 1 s connect timeout) is
    # made up by the next.
    lease = {"job_lease_s": 2.1}
    first, dying = await routers.new(keys=keys, client=held, **lease)
    second, _ = await routers.new(a, keys=keys, **lease)
    running = asyncio.create_task(first.post("/wim", json=JOB, headers=key("acme")))
    await held.started.wait()
    await asyncio.sleep(3.0)  # longer than the lease: renewed while its router lives
    refused(await second.post("/wim", json=JOB, headers=key("acme")))
    # The router dies: it renews nothing and never ends its job.
    assert dying.gate._renewing is not None
    dying.gate._renewing.cancel()
    await asyncio.sleep(2.5)
    assert (await second.post("/wim", json=JOB, headers=key("acme"))).status_code == 200
    running.cancel()


async def test_two_concurrent_creates_on_two_routers_pass_an_open_documents_limit_once(
    routers: Routers,
) -> None:
    a = FakeReplica("a")
    keys = tenants(acme={"open_documents": 1})
    slow = SlowReads(a)
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
