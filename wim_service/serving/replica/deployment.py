"""`EngineReplica`: one vLLM engine in a Ray Serve replica, running WiM jobs and document sessions.

Thin over the engine layer: every method turns a call into `run_wim` / `WiMSession` work and
streams the events back (typed models of `wim.events` and `serving.replica.contracts`). It
implements `ReplicaProtocol` (`replica/protocol.py`): it reports its load for the router's
placement (KV, sessions and the backlog of its admitted work, `placement/backlog.py`), and its
engine's `vllm:*` metrics and its event loop's lag (`observability/loop_lag.py`) for the
router's `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from ray import serve

from wim_service.engine.config import EngineConfig
from wim_service.placement.backlog import Backlog
from wim_service.placement.profile import EngineProfile
from wim_service.serving.observability.logs import keep_serve_logs_from_vllm, log_through_serve
from wim_service.serving.observability.loop_lag import LoopLagMonitor
from wim_service.serving.observability.metrics import StoredKVMetrics, event_loop_lag
from wim_service.serving.replica.contracts import (
    DocumentOpened,
    EngineDead,
    OpenResult,
    ReplicaLoad,
)
from wim_service.serving.replica.held_documents import HeldDocuments
from wim_service.serving.replica.plain import PlainParams, plain_events
from wim_service.serving.replica.protocol import ReplicaProtocol
from wim_service.serving.replica.work import (
    estimated_tokens,
    one_shot_work,
    plain_work,
    session_work,
)
from wim_service.wim.backend import StoredDocument
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import ErrorEvent, WiMEvent
from wim_service.wim.options import WiMOptions
from wim_service.wim.orchestrator import WiMSession, open_document, run_wim

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 5.0


class EngineReplica:
    def __init__(self, engine: dict[str, Any], cost_profile: str | None = None) -> None:
        """`engine` is the `EngineConfig`; `cost_profile` the router's (`RouterConfig`), so
        that the backlog this replica reports is in the costs the router places by."""
        # Ray starts workers at nice 15 and the engine process inherits it; under load such an
        # engine crawls behind everything else on the node.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        log_through_serve()
        keep_serve_logs_from_vllm()
        from wim_service.engine.vllm_engine import VLLMBackend

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.config = EngineConfig.model_validate(engine)
        self.backend = VLLMBackend.start(self.config, rank=context.rank.local_rank)
        self.documents = HeldDocuments()
        # The stored KV (engine/kv_transfer) of each document read here, for the reaper.
        self._stored: dict[str, StoredDocument] = {}
        profile = EngineProfile.load(Path(cost_profile) if cost_profile else None)
        self.backlog = Backlog(profile.for_store(self.backend.kv_store is not None))
        self._reaper: asyncio.Task[None] | None = None
        # This replica's own metrics; vLLM's are in the process's global registry.
        self.registry = CollectorRegistry()
        lag = event_loop_lag(self.registry).labels(deployment="replica", replica=self.replica)
        self.kv_metrics = StoredKVMetrics(self.registry)
        self.loop_lag = LoopLagMonitor(lag)
        # Serve calls the constructor and `__del__` from a coroutine on the event loop that
        # runs this replica's async methods: the loop to watch.
        self.loop_lag.start()

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Close the sessions no router claims (`HeldDocuments`: never one in use), and
        delete their stored KV: no router knows them any more."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            for document_id in await self.documents.reap(time.monotonic()):
                stored = self._stored.pop(document_id, None)
                # Reopened since (a rebuild restoring it here): its stored KV is in use again.
                if stored is not None and document_id not in self.documents:
                    await self.backend.delete_stored(stored)

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        """A router holds these sessions (sent every load poll); unclaimed ones are reaped.
        Returns how many of them this replica has. Async: Serve runs a sync method in a worker
        thread, where the reaper could not be started (no running event loop)."""
        self._ensure_reaper()
        self.documents.orphan_timeout_s = orphan_timeout_s
        return self.documents.claim(document_ids, time.monotonic())

    def _check_engine(self) -> None:
        if not self.backend.healthy:
            raise EngineDead(f"the engine of replica {self.replica} is dead")

    async def _checked(self, events: AsyncIterator[WiMEvent]) -> AsyncIterator[WiMEvent]:
        """`events`, except that a job the engine's death ended raises `EngineDead` (the
        router then runs it elsewhere) instead of reporting an engine error."""
        self._check_engine()
        async for event in events:
            if isinstance(event, ErrorEvent) and not self.backend.healthy:
                raise EngineDead(f"the engine of replica {self.replica} died during the job")
            yield event

    # -- jobs ------------------------------------------------------------------------------

    async def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        """A one-shot job; the caller going away cancels it and frees its KV."""
        job = run_wim(self.backend, self.backend.tokenizer, document, query, options)
        # Its shape estimated from characters: its tokens are counted inside the job.
        tokens = estimated_tokens(document)
        segments = math.ceil(tokens / options.segment_tokens)
        with self.backlog.job(one_shot_work(tokens, segments, 0, options, query)):
            async for event in self._checked(job):
                yield event

    async def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        """A plain request (a short OpenAI-API prompt, no WiM): answer deltas, then `done`."""
        with self.backlog.job(plain_work(len(prompt_ids), params.max_tokens, 0)):
            async for event in self._checked(plain_events(self.backend, prompt_ids, params)):
                yield event

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        """Read a document into a pinned context (unless this replica holds or is reading it:
        `HeldDocuments.open`), saving its KV to the KV store under (`tenant`, `document_id`),
        or restoring it from there if asked and saved; returns its size or an error event."""
        self._ensure_reaper()
        self._check_engine()
        stored = StoredDocument(tenant, document_id) if self.backend.kv_store else None

        async def read() -> WiMSession:
            work = session_work(
                document_id, estimated_tokens(document), 0, options, restorable=restore
            )
            with self.backlog.job(work, copy=True):
                session = await open_document(
                    self.backend,
                    self.backend.tokenizer,
                    document,
                    options,
                    stored=stored,
                    restore=restore,
                )
            await self._count_stored_kv(session, restore)
            return session

        try:
            session = await self.documents.open(document_id, read, time.monotonic)
        except WiMError as exc:
            self._check_engine()
            return ErrorEvent.of(exc)
        if stored is not None:
            self._stored[document_id] = stored
        return DocumentOpened(
            context_tokens=session.plan.context_tokens,
            segments=len(session.plan.segments),
            restored_tokens=session.restored.restored_tokens,
        )

    async def _count_stored_kv(self, session: WiMSession, restore: bool) -> None:
        """Count what a read restored or saved (`wim_kv_*`, once per read)."""
        from wim_service.engine.vllm_context import VLLMContext

        restored, context = session.restored, session.context
        if not isinstance(context, VLLMContext) or context.stored is None:
            return
        if restored.restored_tokens:
            self.kv_metrics.restored_tokens.inc(restored.restored_tokens)
            self.kv_metrics.restore_seconds.observe(restored.seconds)
        elif restore and restored.fallback is not None:
            self.kv_metrics.fallbacks.labels(restored.fallback).inc()
            logger.info("a stored document was read again: %s", restored.fallback)
        report = await context.kv_report()
        self.kv_metrics.saved_tokens.inc(report.saved_tokens)
        if report.save_failed is not None:
            self.kv_metrics.save_failures.labels(report.save_failed).inc()
            logger.warning("a document's KV could not all be saved: %s", report.save_failed)

    async def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        session = self.documents.use(document_id, time.monotonic())
        if session is None:
            yield ErrorEvent(
                code=ErrorCode.NOT_FOUND.value,
                message=f"document session {document_id} is not on this replica",
            )
            return
        plan = session.plan
        work = session_work(
            document_id, plan.context_tokens, 0, options, query=query, segments=len(plan.segments)
        )
        with self.backlog.job(work):
            async for event in self._checked(session.query(query, options)):
                yield event
        # The orphan timeout counts from the query's end, not its start.
        self.documents.use(document_id, time.monotonic())

    async def close_document(self, document_id: str) -> bool:
        """Close a session (DELETE, expiry, a retired copy, a read no router recorded); a query
        running on it ends with `not_found` once the engine has let go of its blocks."""
        return await self.documents.close(document_id)

    # -- reporting -------------------------------------------------------------------------

    async def load(self) -> ReplicaLoad:
        """What the router places sessions by. Answered from memory, never from the engine
        core: a busy engine must still report promptly, or the router would think it gone.
        Computed on the event loop that changes the held sessions and the backlog, so that
        it reads them whole: a worker thread iterated their dicts while the loop changed them
        (now and then a `RuntimeError`, a missed report). It sums over the sessions and jobs
        this replica holds, a few dozen at most."""
        return self._load()

    def _load(self) -> ReplicaLoad:
        admission = self.backend.load()
        return ReplicaLoad(
            replica=self.replica,
            capacity_blocks=admission.capacity_blocks,
            reserved_blocks=admission.reserved_blocks,
            sessions=admission.sessions,
            max_sessions=self.config.max_sessions,
            documents=len(self.documents),
            resident_kv_tokens=sum(s.context.context_tokens for s in self.documents.sessions()),
            healthy=self.backend.healthy,
            backlog_s=self.backlog.seconds(),
            running=self.backlog.running,
            dtype=self.backend.dtype,
        )

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (`serving/replica/autoscaling.py`): how full this
        replica's KV and session slots are, parked document sessions included."""
        from wim_service.serving.replica.autoscaling import KV_RESERVED_FRACTION, SESSION_FRACTION

        admission = self.backend.load()
        return {
            KV_RESERVED_FRACTION: admission.reserved_blocks / max(1, admission.capacity_blocks),
            SESSION_FRACTION: admission.sessions / max(1, self.config.max_sessions),
            "documents": float(len(self.documents)),
        }

    async def metrics_text(self) -> str:
        """This engine's own `vllm:*` Prometheus metrics and this replica's event-loop lag (the
        router adds a replica label); rendered in a worker thread."""
        return await asyncio.to_thread(self._metrics_text)

    def _metrics_text(self) -> str:
        return generate_latest(REGISTRY).decode() + generate_latest(self.registry).decode()

    async def check_health(self) -> None:
        """Serve's health check: a dead engine makes Serve replace this replica."""
        if not self.backend.healthy:
            raise RuntimeError("the vLLM engine of this replica is dead")

    def __del__(self) -> None:
        # Each on its own: a failing stop (a constructor that failed first, the garbage
        # collector's call once the loop is closed) must not skip the engine's shutdown.
        with contextlib.suppress(Exception):
            self.loop_lag.stop()
        with contextlib.suppress(Exception):
            self.backend.shutdown()


def _implements(replica: EngineReplica) -> ReplicaProtocol:
    return replica  # mypy checks that EngineReplica has every method of the protocol
