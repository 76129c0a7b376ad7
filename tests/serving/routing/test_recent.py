"""`serving.routing.recent.Recent`, and the public probes that go through it: however many anonymous
`/readyz` and `/metrics` requests arrive, the engine replicas are asked once per interval."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.replicas import FakeReplica
from tests.serving.routing.test_router_access import service
from wim_service.serving.routing.recent import Recent


class Counting:
    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.fail = False

    async def fetch(self) -> int:
        self.calls += 1
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("down")
        return self.calls


async def test_callers_together_share_one_fetch_and_reuse_it_while_recent() -> None:
    source = Counting()
    recent = Recent(source.fetch, max_age_s=60)
    waiting = [asyncio.create_task(recent.get()) for _ in range(20)]
    await asyncio.sleep(0)
    source.gate.set()
    assert await asyncio.gather(*waiting) == [1] * 20
    assert await recent.get() == 1 and source.calls == 1


async def test_an_old_result_is_fetched_again_and_a_failure_is_not_kept() -> None:
    source = Counting()
    source.gate.set()
    recent = Recent(source.fetch, max_age_s=0)
    assert await recent.get() == 1
    source.fail = True
    with pytest.raises(RuntimeError):
        await recent.get()
    source.fail = False
    assert await recent.get() == 3


async def test_a_caller_that_leaves_does_not_cancel_the_others_fetch() -> None:
    source = Counting()
    recent = Recent(source.fetch, max_age_s=60)
    leaving = asyncio.create_task(recent.get())
    staying = asyncio.create_task(recent.get())
    await asyncio.sleep(0)
    leaving.cancel()
    source.gate.set()
    assert await staying == 1


def test_a_flood_of_probes_and_scrapes_asks_each_replica_once() -> None:
    replicas = (FakeReplica("a"), FakeReplica("b"))
    client, _ = service(*replicas, load_poll_interval_s=60, metrics_interval_s=0)
    client.get("/readyz")  # the first one learns the replicas
    for replica in replicas:
        replica.calls.clear()
    for _ in range(50):
        assert client.get("/readyz").status_code == 200
        assert client.get("/metrics").status_code == 200
    for replica in replicas:
        assert replica.calls.count("load") <= 1, replica.calls
        assert replica.calls.count("metrics_text") == 1, replica.calls
