"""`wim bench --store`: what the session store costs, and whether routers agree on bindings.

(h) the store's work per query (look the session up, hold it while the query runs, release
    it), in-process store vs Redis, p50 and p99 over many queries;
(i) 200 document sessions opened at once through two routers sharing one Redis store: every
    session bound to exactly one replica, none bound twice, each read once.

The routers here are the real `WiMRouter` (placement, store, bindings) over stand-in engine
replicas that answer at once: this measures the router layer, not the engines. Redis is
`WIM_REDIS_URL`, or a `redis-server` started on loopback for the run (no persistence).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from wim_service.benchmarks.common import line
from wim_service.benchmarks.redis_server import RedisServer
from wim_service.serving.config import StoreConfig
from wim_service.serving.http.bodies import DocumentRequest
from wim_service.serving.replica.contracts import DocumentOpened, ReplicaLoad
from wim_service.serving.replica.protocol import CallsByName
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import SessionStore, StoredSession, make_store
from wim_service.serving.store.redis_store import RedisSessionStore, connect
from wim_service.serving.tenants import OPEN_TENANT, ApiKeys
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions

QUERIES = 2000
OPENS = 200
DOCUMENT = "The night gate code is 4417. The harbour master is Ines Varga.\n" * 20


class StandInReplicas(CallsByName):
    """A `ReplicaClient` whose replicas open documents at once and count what they hold."""

    def __init__(self, names: list[str]) -> None:
        self.held: dict[str, Counter[str]] = {name: Counter() for name in names}
        self.in_flight: dict[str, int] = {}

    async def live_replicas(self) -> frozenset[str]:
        return frozenset(self.held)

    async def call(self, replica: str, method: str, *args: Any) -> Any:
        if method == "load":
            return ReplicaLoad(
                replica=replica,
                capacity_blocks=10**9,
                reserved_blocks=0,
                sessions=sum(self.held[replica].values()),
            )
        if method == "open_document":
            self.held[replica][args[0]] += 1
            return DocumentOpened(context_tokens=400, segments=1)
        if method == "close_document":
            return self.held[replica].pop(args[0], 0) > 0
        return 0  # claim, metrics_text

    async def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
        raise NotImplementedError("no jobs in this benchmark")
        yield  # pragma: no cover


class NoRedis(RuntimeError):
    """Neither `WIM_REDIS_URL` nor a redis-server binary to start one: no Redis to measure."""


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """`WIM_REDIS_URL`, or a redis-server of our own on a free loopback port."""
    if os.environ.get("WIM_REDIS_URL"):
        yield os.environ["WIM_REDIS_URL"]
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise NoRedis("set WIM_REDIS_URL or install redis-server")
    with tempfile.TemporaryDirectory(prefix="wim-bench-redis-") as workdir:
        server = RedisServer(binary, Path(workdir)).start()
        try:
            yield server.url
        finally:
            server.stop()


async def _per_query(store: SessionStore) -> list[float]:
    """Seconds of store work per query, as the router does it."""
    table = DocumentTable(store, hold_s=900.0, retry_after_s=5.0)
    session = StoredSession(session_id="doc-bench", options=WiMOptions(), ttl_s=600.0)
    await table.add(session, DOCUMENT)
    await table.rebind("doc-bench", None, "replica-a")
    seconds = []
    for _ in range(QUERIES):
        started = time.perf_counter()
        assert await table.get("doc-bench") is not None
        await table.hold("doc-bench")
        await table.release("doc-bench")
        seconds.append(time.perf_counter() - started)
    await table.remove("doc-bench")
    return seconds


def _quantiles(seconds: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(seconds, n=100)
    return cuts[49] * 1000, cuts[98] * 1000


async def _opens_through_two_routers(url: str) -> tuple[float, int, int, int]:
    config = StoreConfig(backend="redis", key_prefix=f"wim-bench-{os.getpid()}:")
    replicas = StandInReplicas(["replica-a", "replica-b"])
    routers = [
        WiMRouter(
            None,
            {"router": {"replica_wait_s": 0, "store": config.model_dump()}},
            client=replicas,
            keys=ApiKeys(None),
            http_host="127.0.0.1",
            store=RedisSessionStore(connect(url, config), config),
        )
        for _ in range(2)
    ]
    body = DocumentRequest(context=DOCUMENT)
    started = time.perf_counter()
    opened = await asyncio.gather(
        *(routers[i % 2].create_document(body, OPEN_TENANT) for i in range(OPENS))
    )
    seconds = time.perf_counter() - started
    stored = {s.session_id: s.replica for s in await routers[0].documents.holdings()}
    held = Counter(doc for counts in replicas.held.values() for doc in counts.elements())
    twice = sum(1 for count in held.values() if count > 1)
    mismatched = sum(1 for d in opened if stored.get(d.document_id) != d.replica)
    for document in opened:
        await routers[1].delete_document(document.document_id, OPEN_TENANT)
    return seconds, len(stored), twice, mismatched


async def run_store_bench() -> int:
    print(f"(h) session-store work per query ({QUERIES} queries)", flush=True)
    memory = _quantiles(await _per_query(make_store(StoreConfig())))
    line("in-process store p50 / p99", f"{memory[0]:.3f} ms / {memory[1]:.3f} ms")
    with redis_url() as url:
        config = StoreConfig(backend="redis", key_prefix=f"wim-bench-{os.getpid()}:")
        redis = _quantiles(await _per_query(RedisSessionStore(connect(url, config), config)))
        line("Redis store p50 / p99", f"{redis[0]:.3f} ms / {redis[1]:.3f} ms")
        print(f"(i) {OPENS} concurrent document opens through two routers, one Redis", flush=True)
        seconds, stored, twice, mismatched = await _opens_through_two_routers(url)
    line("sessions stored / opened", f"{stored} / {OPENS}")
    line("sessions read on two replicas (double binding)", str(twice))
    line("answers whose replica differs from the store's binding", str(mismatched))
    line("wall time of the 200 opens", f"{seconds:.2f} s")
    load = os.getloadavg()
    line("load average (1, 5, 15 min)", f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0 if stored == OPENS and twice == 0 and mismatched == 0 else 1
