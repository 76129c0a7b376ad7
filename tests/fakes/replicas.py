"""Fake engine replicas for the router's tests: no Ray, no engine.

`FakeReplica` implements `ReplicaProtocol` (`serving/replica/protocol.py`) as `EngineReplica`
does, with the models of `serving.replica.contracts` and `wim.events`; every job streams
`job_events()`. `FakeClient` is a `ReplicaClient` over such replicas: `replica(name)` answers a
typed `ReplicaProtocol` that reaches the fake of that name as a Serve handle would, raising
`ReplicaLost` once it is dead (or mid-stream, after its `die_after` events).

A test changes how calls get through by overriding a typed method: a replica's own method
(a slow `open_document`), or `FakeClient.stream` for what every stream from a replica goes
through (held, delayed, cut, unreachable).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from wim_service.engine.config import EngineConfig
from wim_service.serving.replica.client import ReplicaLost
from wim_service.serving.replica.contracts import DocumentOpened, OpenResult, ReplicaLoad
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.replica.protocol import ReplicaProtocol
from wim_service.wim.events import (
    AnswerEvent,
    DoneEvent,
    ErrorEvent,
    MarginEvent,
    SegmentEvent,
    Timings,
    Usage,
    WiMEvent,
)
from wim_service.wim.options import WiMOptions

SEGMENTS = 3
# An engine's KV block, in tokens: what it saves and restores.
KV_BLOCK_TOKENS = EngineConfig().block_size
DOCUMENT = "The night gate code is 4417. " * 40


def job_events(answer: str = "The code is 4417.", took_s: float = 0.0) -> list[WiMEvent]:
    events: list[WiMEvent] = []
    for i in range(SEGMENTS):
        events.append(
            SegmentEvent(
                segment=i,
                segments=SEGMENTS,
                tokens=10,
                context_tokens=10 * (i + 1),
                char_start=0,
                char_end=1,
            )
        )
        events.append(
            MarginEvent(
                segment=i,
                text=f"margin {i}",
                relevant=i == 1,
                char_start=0,
                char_end=1,
                elapsed_s=0.1,
            )
        )
    events += [AnswerEvent(text=answer[:8]), AnswerEvent(text=answer[8:])]
    events.append(
        DoneEvent(
            answer=answer,
            usage=Usage(context_tokens=30, segments=SEGMENTS, prompt_tokens_cached=7),
            timings=Timings(total_s=took_s),
        )
    )
    return events


class FakeReplica:
    """An engine replica in this process: it implements `ReplicaProtocol` as `EngineReplica`
    does; every job streams `job_events()`."""

    def __init__(self, name: str, capacity: int = 10_000) -> None:
        self.name = name
        self.capacity = capacity
        self.reserved = 0
        self.documents: dict[str, WiMOptions] = {}
        self.calls: list[str] = []  # the protocol methods called, in order
        self.claimed: list[str] = []
        self.die_after: int | None = None  # events streamed before this replica "dies"
        self.dead = False
        self.backlog_s = 0.0  # the expected seconds of work it reports queued
        self.running = 0  # the jobs it reports running
        self.took_s = 0.0  # the engine seconds each of its jobs reports taking (`Timings`)
        self.max_sessions = 1 << 30
        self.dtype = "bfloat16"  # the dtype it reports its engine runs in
        self.opens: list[tuple[str, str, bool]] = []  # (tenant, document, restore) of each read
        # A KV store shared with other fakes: (tenant, document) saved by a read; None: none.
        self.kv_store: set[tuple[str, str]] | None = None

    async def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            replica=self.name,
            capacity_blocks=self.capacity,
            reserved_blocks=self.reserved,
            sessions=len(self.documents),
            max_sessions=self.max_sessions,
            documents=len(self.documents),
            dtype=self.dtype,
            backlog_s=self.backlog_s,
            running=self.running,
        )

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        assert isinstance(options, WiMOptions)
        self.documents[document_id] = options
        self.opens.append((tenant, document_id, restore))
        tokens, key = len(document) // 4, (tenant, document_id)
        stored = restore and self.kv_store is not None and key in self.kv_store
        # As an engine restores: the whole blocks it saved, the tail past them computed.
        restored = tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS if stored else 0
        if self.kv_store is not None:
            self.kv_store.add(key)  # saved as it is read
        return DocumentOpened(context_tokens=tokens, segments=SEGMENTS, restored_tokens=restored)

    async def close_document(self, document_id: str) -> bool:
        return self.documents.pop(document_id, None) is not None

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        self.claimed = list(document_ids)
        return len(set(document_ids) & set(self.documents))

    async def metrics_text(self) -> str:
        return "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"

    async def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        for event in job_events(took_s=self.took_s):
            yield event.model_copy()

    async def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        for event in job_events(took_s=self.took_s):
            yield event.model_copy()

    async def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        if document_id not in self.documents:
            yield ErrorEvent(code="not_found", message="not on this replica")
            return
        for event in job_events(took_s=self.took_s):
            yield event.model_copy()


class SlowReader(FakeReplica):
    """A replica whose reads take `read_s`: requests that start meanwhile overlap the read."""

    def __init__(self, name: str, capacity: int = 10_000, read_s: float = 0.05) -> None:
        super().__init__(name, capacity)
        self.read_s = read_s

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        await asyncio.sleep(self.read_s)
        return await super().open_document(document_id, document, options, tenant, restore)


class FakeClient:
    """`ReplicaClient` over in-process fake replicas."""

    def __init__(self, *replicas: FakeReplica) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.in_flight: dict[str, int] = {}

    async def live_replicas(self) -> frozenset[str]:
        return frozenset(n for n, r in self.replicas.items() if not r.dead)

    def replica(self, name: str) -> ReplicaProtocol:
        return ReachedReplica(self, name)

    def reach(self, name: str, method: str) -> FakeReplica:
        """The replica `name` for a call of `method` (recorded), or `ReplicaLost` if it died."""
        replica = self.replicas[name]
        if replica.dead:
            raise ReplicaLost(name, RuntimeError("actor died"))
        replica.calls.append(method)
        return replica

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        """A job's events from `replica` as they reach the router: cut by `ReplicaLost` once
        the replica has streamed its `die_after` events (it dies)."""
        target = self.replicas[replica]
        n = 0
        async for event in events:
            if event.type != "error" and target.die_after is not None and n >= target.die_after:
                target.dead = True
                raise ReplicaLost(replica, RuntimeError("actor died mid-stream"))
            n += 1
            yield event


class ReachedReplica:
    """`ReplicaProtocol` for one fake replica, through its `FakeClient`: each call reaches the
    replica only when it is made (a stream's, at its first event), as a Serve handle's does."""

    def __init__(self, client: FakeClient, name: str) -> None:
        self.client, self.name = client, name

    async def load(self) -> ReplicaLoad:
        return await self.client.reach(self.name, "load").load()

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        return await self.client.reach(self.name, "claim").claim(document_ids, orphan_timeout_s)

    async def metrics_text(self) -> str:
        return await self.client.reach(self.name, "metrics_text").metrics_text()

    def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        return self._stream("run", lambda replica: replica.run(document, query, options))

    def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        return self._stream("complete", lambda replica: replica.complete(prompt_ids, params))

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        replica = self.client.reach(self.name, "open_document")
        return await replica.open_document(document_id, document, options, tenant, restore)

    def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        return self._stream(
            "query_document", lambda replica: replica.query_document(document_id, query, options)
        )

    async def close_document(self, document_id: str) -> bool:
        return await self.client.reach(self.name, "close_document").close_document(document_id)

    async def _stream(
        self, method: str, job: Callable[[FakeReplica], AsyncIterator[WiMEvent]]
    ) -> AsyncIterator[WiMEvent]:
        async for event in self.client.stream(self.name, job(self.client.reach(self.name, method))):
            yield event
