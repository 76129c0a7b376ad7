"""`WiMRouter`: the HTTP ingress. Pins document sessions to engine replicas and fails them over.

* A binding table maps each session to one `EngineReplica`; every call of the session goes
  there (`PinnedReplicaRouter`). New sessions go to the replica with the most free KV that can
  hold the session's worst case (bounded load); replicas report their load every few seconds.
* Document sessions keep their text here for their life. If the pinned replica dies or leaves
  (scale-down), the session is re-pinned to another replica and rebuilt from that text, and
  the request that found it gone is retried there: the client still gets its answer.
* Errors are HTTP statuses with a JSON body `{code, message}`; overload is 429/503 with
  Retry-After; a streamed job reports late errors as an `error` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import TypeAdapter
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from wim_service.engine.config import EngineConfig
from wim_service.serving.api import (
    DocumentRequest,
    DocumentResponse,
    ErrorBody,
    MarginOut,
    WiMRequest,
    WiMResponse,
)
from wim_service.serving.bindings import BindingTable, BindResult, NoCapacity, ReplicaLoad
from wim_service.serving.config import ServiceConfig
from wim_service.serving.metrics import WiMMetrics
from wim_service.serving.pinning import ReplicaGone, live_replicas, target_key
from wim_service.serving.vllm_metrics import merge_replica_metrics
from wim_service.wim.backend import EngineLimits
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import DoneEvent, ErrorEvent, WiMEvent
from wim_service.wim.options import WiMOptions
from wim_service.wim.orchestrator import reserve_blocks

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
_EVENT = TypeAdapter(WiMEvent)
# Failures that mean "the replica is gone", not "the job is bad": the session moves.
REPLICA_LOST = (ReplicaGone, RayActorError, ActorDiedError, ActorUnavailableError)
STATUS = {
    ErrorCode.INVALID_INPUT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.TOO_LONG: 413,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.CANCELLED: 499,
    ErrorCode.ENGINE_ERROR: 502,
}
# Document-level options: fixed when a document is read (they shape its KV).
DOCUMENT_FIELDS = ("segment_tokens", "max_segment_tokens")
DOCUMENT_PROMPTS = ("system", "document")

app = FastAPI(
    title="wim_service",
    summary="Long-document question answering with Writing in the Margins on vLLM.",
    description=(
        'One-shot: `POST /wim {"context": "...", "query": "..."}`. '
        "Many queries on one document: `POST /documents`, then `POST /wim` with its "
        '`document_id`. Add `"stream": true` for server-sent events.'
    ),
    version="0.1.0",
)


class HTTPFailure(Exception):
    """An error answered as an HTTP status (before any byte of a stream was sent)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    @classmethod
    def from_event(cls, code: str, message: str, retry_after: float | None) -> HTTPFailure:
        return cls(STATUS.get(ErrorCode(code), 500), code, message, retry_after)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(
            ErrorBody(code=self.code, message=self.message).model_dump(),
            status_code=self.status,
            headers=headers,
        )


@app.exception_handler(HTTPFailure)
async def _http_failure(_: Request, exc: HTTPFailure) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
    )
    return JSONResponse(
        ErrorBody(code="invalid_request", message=problems).model_dump(), status_code=422
    )


@dataclass
class DocumentRecord:
    """A document session as the router keeps it: enough to rebuild it anywhere."""

    document_id: str
    text: str
    options: WiMOptions
    ttl_s: float
    context_tokens: int = 0
    segments: int = 0
    last_used: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def expires_at(self) -> float:
        return self.last_used + self.ttl_s


@dataclass
class _Progress:
    """What a streamed job already delivered, so that a failover does not repeat it."""

    segments: set[int] = field(default_factory=set)
    margins: set[int] = field(default_factory=set)
    answer_sent: int = 0  # answer characters the client has
    answer_seen: int = 0  # answer characters of the current attempt

    def new_attempt(self) -> None:
        self.answer_seen = 0

    def fresh(self, event: WiMEvent) -> bool:
        """False for what an earlier attempt already delivered (answer text is trimmed)."""
        if event.type in ("segment", "margin"):
            seen = self.segments if event.type == "segment" else self.margins
            if event.segment in seen:
                return False
            seen.add(event.segment)
        elif event.type == "answer":
            # Greedy decoding repeats the same answer; `done.answer` is authoritative anyway.
            start = self.answer_seen
            self.answer_seen += len(event.text)
            event.text = event.text[max(0, self.answer_sent - start) :]
            self.answer_sent = max(self.answer_sent, self.answer_seen)
            return bool(event.text)
        return True


def _check_document_options(fixed: WiMOptions, asked: WiMOptions) -> None:
    changed = [
        f
        for f in DOCUMENT_FIELDS
        if f in asked.model_fields_set and getattr(asked, f) != getattr(fixed, f)
    ]
    if "prompts" in asked.model_fields_set:
        changed += [
            f"prompts.{p}"
            for p in DOCUMENT_PROMPTS
            if getattr(asked.prompts, p) != getattr(fixed.prompts, p)
        ]
    if changed:
        raise HTTPFailure(
            422,
            ErrorCode.INVALID_INPUT.value,
            f"{', '.join(changed)} were fixed when the document was read; "
            "upload the document again to change them",
        )


def _document_response(record: DocumentRecord, replica: str) -> DocumentResponse:
    return DocumentResponse(
        document_id=record.document_id,
        context_tokens=record.context_tokens,
        segments=record.segments,
        expires_at=record.expires_at,
        replica=replica,
    )


async def _first(
    events: AsyncIterator[tuple[str, WiMEvent]],
) -> tuple[str, WiMEvent]:
    try:
        return await anext(events)
    except WiMError as exc:
        raise HTTPFailure.from_event(exc.code.value, exc.message, exc.retry_after_s) from exc
    except StopAsyncIteration as exc:
        raise HTTPFailure(502, ErrorCode.ENGINE_ERROR.value, "the job produced no output") from exc


async def _rest(
    first: tuple[str, WiMEvent], events: AsyncIterator[tuple[str, WiMEvent]]
) -> AsyncIterator[tuple[str, WiMEvent]]:
    """The whole job again (first event included); a late failure becomes an error event."""
    yield first
    replica = first[0]
    try:
        async for replica, event in events:
            yield replica, event
    except WiMError as exc:
        yield replica, ErrorEvent(code=exc.code.value, message=exc.message)


async def _collect(items: AsyncIterator[tuple[str, WiMEvent]], session_id: str) -> Response:
    margins: dict[int, MarginOut] = {}
    async for replica, event in items:
        if event.type == "margin":
            margins[event.segment] = MarginOut(
                segment=event.segment, text=event.text, relevant=event.relevant
            )
        elif event.type == "error":
            raise HTTPFailure.from_event(event.code, event.message, event.retry_after_s)
        elif isinstance(event, DoneEvent):
            body = WiMResponse(
                answer=event.answer,
                margins=[margins[k] for k in sorted(margins)],
                usage=event.usage,
                timings=event.timings,
                session_id=session_id,
                replica=replica,
            )
            return JSONResponse(body.model_dump())
    raise HTTPFailure(502, ErrorCode.ENGINE_ERROR.value, "the job ended without an answer")


async def _sse(items: AsyncIterator[tuple[str, WiMEvent]], session_id: str) -> AsyncIterator[str]:
    async for replica, event in items:
        data = event.model_dump(exclude={"type"})
        if event.type == "done":
            data.update(session_id=session_id, replica=replica)
        yield f"event: {event.type}\ndata: {json.dumps(data)}\n\n"


# Serve pickles the deployment class when it is decorated: every helper it uses must already
# be defined above it.
@serve.deployment(name="WiMRouter", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class WiMRouter:
    def __init__(self, engine: DeploymentHandle, config: dict[str, Any]) -> None:
        self.engine = engine
        self.config = ServiceConfig.model_validate(config)
        self.table = BindingTable()
        self.documents: dict[str, DocumentRecord] = {}
        self.metrics = WiMMetrics()
        self._tokenizer: Any = None
        self._background: asyncio.Task[None] | None = None
        self._in_flight: dict[str, int] = {}  # replica -> calls this router has open on it

    # -- background: loads, TTL ------------------------------------------------------------

    def _ensure_background(self) -> None:
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._maintain())

    async def _maintain(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh_loads()
                await self._expire_documents()
            await asyncio.sleep(self.config.router.load_poll_interval_s)

    async def refresh_loads(self) -> None:
        replicas = live_replicas(ENGINE_DEPLOYMENT)
        if not replicas:
            # The pinning router learns the replica set on the handle's first call.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.load.remote(), 10)
            replicas = live_replicas(ENGINE_DEPLOYMENT)
        replicas = sorted(replicas)
        results = await asyncio.gather(
            *(self._load_of(r) for r in replicas), return_exceptions=True
        )
        loads = []
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, ReplicaLoad):
                loads.append(result)
            else:
                logger.warning("engine replica %s did not report its load: %r", replica, result)
        self.table.update_replicas(set(replicas), loads)
        self.metrics.sessions_active.clear()
        self.metrics.resident_kv_tokens.clear()
        for load in loads:
            self.metrics.sessions_active.labels(load.replica).set(load.sessions)
            self.metrics.resident_kv_tokens.labels(load.replica).set(load.resident_kv_tokens)
        # A replica that left the routing set while calls of ours still run on it is draining:
        # Serve lets those calls finish before it stops the replica.
        self.metrics.replica_draining.clear()
        for replica, calls in self._in_flight.items():
            if calls and replica not in replicas:
                self.metrics.replica_draining.labels(replica).set(1)

    async def _load_of(self, replica: str) -> ReplicaLoad:
        load = await asyncio.wait_for(self._call(replica, "load"), 10)
        return ReplicaLoad(**load)

    async def _expire_documents(self) -> None:
        now = time.time()
        for record in [r for r in self.documents.values() if r.expires_at < now]:
            logger.info("document session %s expired", record.document_id)
            await self._close_document(record)

    # -- calls to engine replicas ----------------------------------------------------------

    def _handle(self, replica: str, method: str, *, stream: bool = False) -> DeploymentHandle:
        return self.engine.options(
            method_name=method, stream=stream, session_id=target_key(replica)
        )

    async def _call(self, replica: str, method: str, *args: Any) -> Any:
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        try:
            return await self._handle(replica, method).remote(*args)
        finally:
            self._in_flight[replica] -= 1

    async def _stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        response = self._handle(replica, method, stream=True).remote(*args)
        try:
            async for item in response:
                yield _EVENT.validate_python(item)
        finally:
            # A client gone mid-stream cancels the replica's job: it closes its context.
            response.cancel()
            self._in_flight[replica] -= 1

    # -- placement -------------------------------------------------------------------------

    def _limits(self) -> EngineLimits:
        engine: EngineConfig = self.config.engine
        return EngineLimits(engine.max_model_len, engine.block_size, concurrent_branches=True)

    def _tokens(self, text: str) -> int:
        if self._tokenizer is None:
            from wim_service.assets.default_model import default_model_dir
            from wim_service.wim.tokenizer import HFTokenizer

            self._tokenizer = HFTokenizer(self.config.engine.model or default_model_dir())
        return len(self._tokenizer.encode_user_text(text).ids)

    def _needed_blocks(self, text: str, options: WiMOptions, query: str = "") -> int:
        tokens = self._tokens(text)
        limit = self.config.engine.max_model_len
        if tokens >= limit:
            raise HTTPFailure(
                413,
                ErrorCode.TOO_LONG.value,
                f"the document is {tokens} tokens; the model's context window is {limit}",
            )
        segments = max(1, math.ceil(tokens / options.segment_tokens))
        query_tokens = self._tokens(query) if query else 256
        return reserve_blocks(tokens, segments, options, self._limits(), query_tokens)

    async def _place(self, session: str, needed: int, exclude: set[str]) -> str:
        """Bind a session to a replica with room, waiting a while for one to come up."""
        deadline = time.monotonic() + self.config.router.replica_wait_s
        while True:
            try:
                return self.table.place(session, needed, exclude=exclude)
            except NoCapacity as exc:
                if exc.live or time.monotonic() > deadline:
                    self.metrics.binding.labels(BindResult.REJECTED).inc()
                    if exc.live:
                        raise HTTPFailure(
                            429,
                            ErrorCode.OVERLOADED.value,
                            f"every engine replica's KV is committed ({exc}); retry later",
                            self.config.router.retry_after_s,
                        ) from exc
                    raise HTTPFailure(
                        503,
                        ErrorCode.OVERLOADED.value,
                        "no engine replica is ready; retry later",
                        self.config.router.retry_after_s,
                    ) from exc
            # No live replica (starting, or replacing a failed one): wait for one.
            await asyncio.sleep(1.0)
            await self.refresh_loads()

    def _lost(self, replica: str, reason: str) -> None:
        self.metrics.failover.labels(reason).inc()
        load = self.table.loads.get(replica)
        if load is not None:
            load.healthy = False

    # -- documents -------------------------------------------------------------------------

    async def _open_on_replica(self, record: DocumentRecord, exclude: set[str]) -> str:
        """Read the document on a replica (placing it first); retried elsewhere if one dies."""
        needed = self._needed_blocks(record.text, record.options)
        while True:
            replica = await self._place(record.document_id, needed, exclude)
            try:
                result = await self._call(
                    replica,
                    "open_document",
                    record.document_id,
                    record.text,
                    record.options.model_dump(),
                    record.ttl_s,
                )
            except REPLICA_LOST:
                self._lost(replica, "replica_lost")
                exclude.add(replica)
                continue
            if result.get("type") == "error":
                self.table.unbind(record.document_id)
                raise HTTPFailure.from_event(
                    result["code"], result["message"], result.get("retry_after_s")
                )
            record.context_tokens = result["context_tokens"]
            record.segments = result["segments"]
            return replica

    async def _close_document(self, record: DocumentRecord) -> None:
        self.documents.pop(record.document_id, None)
        replica = self.table.replica_of(record.document_id)
        self.table.unbind(record.document_id)
        if replica is not None:
            with contextlib.suppress(Exception):
                await self._call(replica, "close_document", record.document_id)

    async def _document_replica(self, record: DocumentRecord) -> str:
        """The replica holding the document; rebuilt elsewhere if its replica is gone."""
        replica = self.table.replica_of(record.document_id)
        if replica is not None and self.table.is_live(replica):
            self.metrics.binding.labels(BindResult.HIT).inc()
            return replica
        reason = "replica_left" if replica is not None else "session_lost"
        return await self._repin(record, replica, reason)

    async def _repin(self, record: DocumentRecord, old: str | None, reason: str) -> str:
        if old is not None:
            self._lost(old, reason)
        replica = await self._open_on_replica(record, {old} if old else set())
        self.metrics.binding.labels(BindResult.REPIN).inc()
        self.metrics.reprefill_tokens.inc(record.context_tokens)
        logger.info("document %s re-pinned %s -> %s (%s)", record.document_id, old, replica, reason)
        return replica

    # -- the job stream with failover ------------------------------------------------------

    async def _job(
        self, request: WiMRequest, session_id: str, progress: _Progress
    ) -> AsyncIterator[tuple[str, WiMEvent]]:
        """Events of one job as (replica, event), failing over when its replica is lost."""
        record = self.documents.get(request.document_id) if request.document_id else None
        try:
            async for item in self._attempts(request, session_id, progress, record):
                yield item
        finally:
            if record is None:
                self.table.unbind(session_id)

    async def _attempts(
        self,
        request: WiMRequest,
        session_id: str,
        progress: _Progress,
        record: DocumentRecord | None,
    ) -> AsyncIterator[tuple[str, WiMEvent]]:
        failovers = 0
        exclude: set[str] = set()
        replica: str | None = None
        while True:
            progress.new_attempt()
            if record is not None:
                async with record.lock:
                    replica = await self._document_replica(record)
                record.last_used = time.time()
                events = self._stream(
                    replica,
                    "query_document",
                    record.document_id,
                    request.query,
                    request.options.model_dump(),
                )
            else:
                if replica is None:
                    needed = self._needed_blocks(
                        request.context or "", request.options, request.query
                    )
                    replica = await self._place(session_id, needed, exclude)
                    self.metrics.binding.labels(
                        BindResult.REPIN if failovers else BindResult.NEW
                    ).inc()
                events = self._stream(
                    replica, "run", request.context, request.query, request.options.model_dump()
                )
            try:
                async for event in events:
                    if (
                        record is not None
                        and event.type == "error"
                        and event.code == ErrorCode.NOT_FOUND.value
                    ):
                        # The replica no longer has this session (restarted): rebuild it.
                        raise ReplicaGone(event.message)
                    if progress.fresh(event):
                        yield replica, event
                return
            except (HTTPFailure, WiMError, asyncio.CancelledError):
                raise
            except REPLICA_LOST as exc:
                failovers += 1
                if failovers > self.config.router.max_failovers:
                    raise WiMError(
                        ErrorCode.ENGINE_ERROR, f"engine replicas kept failing: {exc}"
                    ) from exc
                logger.warning("replica %s lost mid-request (%s); failing over", replica, exc)
                if record is not None:
                    async with record.lock:
                        if self.table.replica_of(record.document_id) == replica:
                            await self._repin(record, replica, "replica_lost")
                else:
                    self._lost(replica, "replica_lost")
                    exclude.add(replica)
                    self.table.unbind(session_id)
                    replica = None
            except Exception as exc:  # a bug or engine fault on the replica: not retried
                logger.exception("job failed on replica %s", replica)
                raise WiMError(ErrorCode.ENGINE_ERROR, f"engine error: {exc}") from exc

    def _observe(self, event: WiMEvent, started: float, marks: dict[str, float]) -> None:
        now = time.perf_counter()
        if event.type == "segment":
            self.metrics.segment_prefill_seconds.observe(now - marks.get("segment", started))
            marks["segment"] = now
        elif event.type == "margin":
            self.metrics.margin_seconds.observe(event.elapsed_s)
            self.metrics.margins.labels(str(event.relevant).lower()).inc()
        elif event.type == "answer" and "ttft" not in marks:
            marks["ttft"] = now
            self.metrics.query_ttft_seconds.observe(now - started)
        elif event.type == "done":
            self.metrics.prefix_cache_hit_tokens.inc(event.usage.prompt_tokens_cached)

    async def _events(
        self, request: WiMRequest, session_id: str
    ) -> AsyncIterator[tuple[str, WiMEvent]]:
        """`_job` plus metrics; raises HTTPFailure for errors before any event was produced."""
        self._ensure_background()
        if not self.table.loads:
            await self.refresh_loads()
        started, marks = time.perf_counter(), {}
        status = "error"
        try:
            async for replica, event in self._job(request, session_id, _Progress()):
                self._observe(event, started, marks)
                if event.type == "error":
                    status = str(STATUS.get(ErrorCode(event.code), 500))
                elif event.type == "done":
                    status = "200"
                yield replica, event
        except HTTPFailure as exc:
            status = str(exc.status)
            raise
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            self.metrics.requests.labels(status).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - started)

    # -- HTTP ------------------------------------------------------------------------------

    def _check_size(self, text: str) -> None:
        limit = self.config.router.max_document_chars
        if len(text) > limit:
            raise HTTPFailure(
                413,
                ErrorCode.TOO_LONG.value,
                f"the document has {len(text)} characters; this service takes at most {limit}",
            )

    def _document(self, document_id: str) -> DocumentRecord:
        record = self.documents.get(document_id)
        if record is None or record.expires_at < time.time():
            raise HTTPFailure(
                404, ErrorCode.NOT_FOUND.value, f"no document session {document_id!r}"
            )
        return record

    @app.post(
        "/wim", response_model=WiMResponse, responses={200: {"content": {"text/event-stream": {}}}}
    )
    async def wim(self, body: WiMRequest) -> Response:
        """Answer a query about a document: one-shot (`context`) or a session (`document_id`)."""
        if body.context is not None:
            self._check_size(body.context)
            session_id = "job-" + secrets.token_hex(8)
        else:
            record = self._document(body.document_id or "")
            _check_document_options(record.options, body.options)
            session_id = record.document_id
        events = self._events(body, session_id)
        # The first event decides the status: errors before any output are HTTP errors.
        first = await _first(events)
        if first[1].type == "error":
            raise HTTPFailure.from_event(first[1].code, first[1].message, first[1].retry_after_s)
        items = _rest(first, events)
        if body.stream:
            return StreamingResponse(
                _sse(items, session_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
            )
        return await _collect(items, session_id)

    @app.post("/documents", response_model=DocumentResponse, status_code=201)
    async def create_document(self, body: DocumentRequest) -> DocumentResponse:
        """Read a document once and pin its KV on one engine replica for later queries."""
        self._ensure_background()
        self._check_size(body.context)
        if not self.table.loads:
            await self.refresh_loads()
        router = self.config.router
        ttl = min(body.ttl_s or router.session_ttl_s, router.max_session_ttl_s)
        record = DocumentRecord("doc-" + secrets.token_hex(12), body.context, body.options, ttl)
        status = "error"
        try:
            replica = await self._open_on_replica(record, set())
            self.metrics.binding.labels(BindResult.NEW).inc()
            self.documents[record.document_id] = record
            status = "201"
        except HTTPFailure as exc:
            status = str(exc.status)
            raise
        finally:
            self.metrics.requests.labels(status).inc()
        return _document_response(record, replica)

    @app.get("/documents/{document_id}", response_model=DocumentResponse)
    async def get_document(self, document_id: str) -> DocumentResponse:
        record = self._document(document_id)
        return _document_response(record, self.table.replica_of(document_id) or "")

    @app.delete("/documents/{document_id}", status_code=204)
    async def delete_document(self, document_id: str) -> Response:
        """End a document session: its KV is freed and purged from the engine's cache."""
        await self._close_document(self._document(document_id))
        return Response(status_code=204)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(self) -> JSONResponse:
        await self.refresh_loads()
        ready = [load.replica for load in self.table.loads.values() if load.healthy]
        return JSONResponse(
            {"ready": bool(ready), "replicas": ready}, status_code=200 if ready else 503
        )

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: the WiM metrics and every replica's `vllm:*` metrics."""
        replicas = sorted(self.table.loads)
        texts = await asyncio.gather(
            *(asyncio.wait_for(self._call(r, "metrics_text"), 10) for r in replicas),
            return_exceptions=True,
        )
        body = generate_latest(self.metrics.registry).decode() + merge_replica_metrics(
            {r: t for r, t in zip(replicas, texts, strict=True) if isinstance(t, str)}
        )
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
