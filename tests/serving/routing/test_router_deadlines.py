"""Engine replicas that stop answering without anyone saying they died (their node lost while
the head's GCS is down): the router takes them for lost on its own evidence, the load calls
they leave unanswered, ends the calls open on them and fails their work over
(`serving/replica/watch.py`, `ReplicaFleet._condemn_silent`); a request with nowhere to go is
answered 503 with `Retry-After` in its route's shape. Over fake replicas, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica
from tests.fakes.router import counted
from tests.serving.routing.test_router_logic import metric
from wim_service.serving.http.bodies import DocumentRequest, WiMRequest
from wim_service.serving.http.responses import Item
from wim_service.serving.ingress import build_http_app
from wim_service.serving.replica.contracts import ReplicaLoad
from wim_service.serving.replica.watch import ReplicaSilent, WatchedClient
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import OPEN_TENANT
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions

# Far below the fleet's poll wait (1 s), which a replica that never answers always takes: the
# silent one is past it at the poll's end, one that answered in that poll never is.
SILENCE_S = 0.5


class Silent(FakeReplica):
    """A replica that can go silent: its calls then never answer, and nothing says it died
    (Ray, while the GCS is down)."""

    def __init__(self, name: str, capacity: int = 10_000) -> None:
        super().__init__(name, capacity)
        self.answering = asyncio.Event()  # its load calls wait while it is clear
        self.answering.set()
        self.hung = asyncio.Event()  # set when a query waits on it silent

    @property
    def silent(self) -> bool:
        return not self.answering.is_set()

    @silent.setter
    def silent(self, silent: bool) -> None:
        if silent:
            self.answering.clear()
        else:
            self.answering.set()

    async def load(self) -> ReplicaLoad:
        await self.answering.wait()
        return await super().load()

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        await self.answering.wait()
        return await super().claim(document_ids, orphan_timeout_s)

    async def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        if self.silent:
            self.hung.set()
            await asyncio.Event().wait()
        async for event in super().query_document(document_id, query, options):
            yield event


def router_over(*replicas: FakeReplica, **router: object) -> WiMRouter:
    config = {
        "router": {"replica_wait_s": 0, "metrics_interval_s": 0, "replica_silence_s": SILENCE_S}
    }
    config["router"].update(router)
    return WiMRouter(None, config, client=FakeClient(*replicas), http_host="127.0.0.1")


async def events_of(router: WiMRouter, document_id: str) -> list[Item]:
    body = WiMRequest(document_id=document_id, query="code?")
    _, items = await router.start_job(body, OPEN_TENANT)
    return [item async for item in items]


async def test_a_replica_that_stops_answering_is_lost_and_its_session_restored_elsewhere() -> None:
    a, b = Silent("a", capacity=100_000), Silent("b")
    a.kv_store = b.kv_store = set()  # the engines share one KV store
    router = router_over(a, b)
    try:
        await router.fleet.refresh_loads()
        opened = await router.create_document(DocumentRequest(context=DOCUMENT), OPEN_TENANT)
        holder, other = (a, b) if opened.replica == "a" else (b, a)
        holder.silent = True
        job = asyncio.create_task(events_of(router, opened.document_id))
        await holder.hung.wait()
        # The query waits on the silent replica, and nothing would end it. A poll finds the
        # replica silent past `replica_silence_s`: the query's call ends, the session is
        # rebuilt on the other replica from its stored KV, and the query answered there.
        await router.fleet.refresh_loads()
        items = await job
    finally:
        router.shutdown()
    assert [replica for replica, _ in items] == [other.name] * len(items)
    assert items[-1][1].type == "done"
    assert other.opens[-1] == ("", opened.document_id, True)  # restored, not read again
    assert not router.fleet.ledger.is_live(holder.name)
    assert counted(router, "wim_session_failover_total", reason="replica_silent") == 1
    assert counted(router, "wim_session_failover_total", reason="replica_lost") == 0


async def test_a_silent_replica_that_answers_again_takes_work_again() -> None:
    a = Silent("a")
    router = router_over(a)
    try:
        await router.fleet.refresh_loads()
        a.silent = True
        await router.fleet.refresh_loads()
        assert not router.fleet.ledger.is_live("a")
        a.silent = False
        await router.fleet.refresh_loads()
    finally:
        router.shutdown()
    assert router.fleet.ledger.is_live("a")


async def test_a_condemned_replica_ends_the_calls_open_on_it_and_no_later_one() -> None:
    hang, a = asyncio.Event(), FakeReplica("a")
    watched = WatchedClient(FakeClient(a))

    async def hung(*_: object) -> int:
        hang.set()
        await asyncio.Event().wait()
        return 0

    a.claim = hung  # type: ignore[method-assign]
    call = asyncio.create_task(watched.replica("a").claim([], 1.0))
    await hang.wait()
    watched.condemn("a")
    try:
        await call
    except ReplicaSilent as exc:
        assert exc.replica == "a" and not exc.transient
    else:
        raise AssertionError("the call on the condemned replica was not ended")
    # A call made after the verdict runs: the replica may answer again.
    assert await watched.replica("a").close_document("doc") is False


def test_a_query_with_no_replica_left_is_503_with_retry_after_in_the_routes_shape() -> None:
    a = Silent("a")
    # Polled often, so that the silence is found while the request waits. Past the first
    # poll's wait (1 s), so that the maintenance loop's claim waits on the silent replica
    # before the silence is found: it must not hold the polls back.
    router = router_over(a, load_poll_interval_s=0.05, replica_silence_s=1.5)
    client = TestClient(build_http_app(router))
    with client:
        opened = client.post("/documents", json={"context": DOCUMENT})
        assert opened.status_code == 201, opened.text
        document_id = opened.json()["document_id"]
        a.silent = True
        answer = client.post("/wim", json={"document_id": document_id, "query": "code?"})
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "5"
        assert answer.json() == {
            "code": "unavailable",
            "message": "no engine replica is ready; retry later",
        }
        assert metric(client, "wim_session_failover_total", reason="replica_silent") == 1
