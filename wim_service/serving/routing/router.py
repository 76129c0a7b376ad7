"""`WiMRouter`: the service's logic behind the HTTP API: document sessions, placement, failover.

* `ReplicaFleet` polls the engine replicas' loads and places work on them by the configured
  policy (`wim_service/placement/`, `RouterConfig.placement`); every call of a session goes
  to a replica holding it (`PinnedReplicaRouter`).
* `DocumentTable` keeps each document session (text, options, tenant, binding, copies,
  expiry) in the session store: in this process, or in Redis shared by every router replica.
  `Dispatcher` (`routing/dispatcher.py`) runs jobs on the bound replica (a hot document's
  queries are shared with copies on other replicas, `routing/copies.py`) and, if that replica
  dies or leaves, hands the session to a live copy or rebuilds it elsewhere from the text
  (`routing/failover.py`) and retries, so the client still gets its answer.
* A request fails with a `ServiceError` (`serving/errors.py`), whose code gives its HTTP
  status; a streamed job reports late errors as an `error` event (`http/responses.py`).
* `LoopLagMonitor` measures how late the router's event loop runs
  (`observability/loop_lag.py`), from the HTTP app's start to its shutdown.

A plain class that builds no web app and sees no request or connection: it takes the API's
parsed bodies (`http/bodies.py`), reads uploads with `http/pdf.py`, and returns bodies and
streams of items (`http/responses.py`). `serving/ingress.py` builds the ASGI app (routes,
edge limits, error answers) over it, and `serving/app.py` makes that the Serve ingress
deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from wim_service.serving.config import ServiceConfig
from wim_service.serving.errors import ServiceError, status_of
from wim_service.serving.http.bodies import DocumentRequest, DocumentResponse, WiMRequest
from wim_service.serving.http.keepalive import next_or_none
from wim_service.serving.http.pdf import PdfExtractor
from wim_service.serving.http.responses import Item, started
from wim_service.serving.observability.loop_lag import LoopLagMonitor
from wim_service.serving.observability.metrics import JobObserver, WiMMetrics
from wim_service.serving.observability.vllm_metrics import merge_replica_metrics
from wim_service.serving.replica.client import ReplicaClient, ServeReplicaClient
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.routing.bindings import BindResult
from wim_service.serving.routing.dispatcher import Dispatcher
from wim_service.serving.routing.documents import (
    DocumentTable,
    check_document_options,
    document_response,
)
from wim_service.serving.routing.fleet import ReplicaFleet
from wim_service.serving.routing.quotas import JobLease, TenantGate
from wim_service.serving.routing.recent import Paced, Recent
from wim_service.serving.routing.sizing import JobSizer
from wim_service.serving.routing.store_reach import Witnesses, held, store_reach
from wim_service.serving.store import Holding, SessionStore, StoredSession, make_store
from wim_service.serving.tenants import ApiKeys, Capability, Tenant, check_open_mode
from wim_service.wim.errors import ErrorCode, WiMError

logger = logging.getLogger(__name__)

# The engine replicas' metrics in `/metrics` are at most this old (a scrape every 15 s or
# more is usual; faster scrapes share one fetch).
METRICS_MAX_AGE_S = 5.0
KV_STORE_UPKEEP_S = 15.0
# A replica's claim call is given up after this long (`_claim_documents`).
CLAIM_TIMEOUT_S = 5.0


class WiMRouter:
    def __init__(
        self,
        engine: Any,
        config: dict[str, Any],
        *,
        client: ReplicaClient | None = None,
        keys: ApiKeys | None = None,
        http_host: str | None = None,
        store: SessionStore | None = None,
        witnesses: Witnesses | None = None,
    ) -> None:
        """`engine` is the EngineReplica deployment's handle. Tests pass `client` (fake
        replicas), `keys` (instead of the environment's), `http_host` (instead of Serve's),
        `store` (instead of the one `RouterConfig.store` names) and `witnesses` (the peers'
        reaches of the store, instead of the GCS's)."""
        self.config = ServiceConfig.model_validate(config)
        self.keys = keys or ApiKeys.from_env()
        check_open_mode(self.keys, http_host or _serve_http_host())
        self.name = _replica_name()
        self.metrics = WiMMetrics()
        self.loop_lag = LoopLagMonitor(
            self.metrics.event_loop_lag.labels(deployment="router", replica=self.name)
        )
        self.client = client or ServeReplicaClient(engine)
        self.fleet = ReplicaFleet(self.client, self.config.router, self.metrics)
        router = self.config.router
        store = store or make_store(router.store)
        # Serve's health check fails while this router alone cannot reach a shared store.
        self.reach = store_reach(self.name, store, router.store, witnesses)
        # Tenant limits are counted in the session store: with Redis, across every router.
        self.gate = TenantGate(store, router, self.keys.document_tenants, self.keys.limits)
        self.documents = DocumentTable(
            store, hold_s=router.request_timeout_s, retry_after_s=router.retry_after_s
        )
        sizer = JobSizer(self.config.engine)
        # Before Serve routes anything here, not on the first request's time.
        sizer.warm_up()
        # Its calls end when the fleet takes their replica for lost (`replica/watch.py`).
        self.dispatcher = Dispatcher(
            self.fleet.watched, self.fleet, self.documents, sizer, router, self.metrics, self.gate
        )
        self.pdf = PdfExtractor(self.config.router)
        self._background: asyncio.Task[None] | None = None
        # What the public probes and scrapes ask of the engine replicas, at most once per
        # poll interval / `METRICS_MAX_AGE_S` however many requests come
        # (`serving/routing/recent.py`).
        self._loads = Recent(self.fleet.refresh_loads, router.load_poll_interval_s)
        self._replica_metrics = Recent(self._fetch_replica_metrics, METRICS_MAX_AGE_S)
        # The KV store's upkeep: what is past its age deleted, its size measured
        # (`wim_kv_store_bytes`; a directory store is walked to measure).
        self._kv_store_upkeep = Recent(self.dispatcher.stored_kv.maintain, KV_STORE_UPKEEP_S)
        self._metrics_page = Paced(self._render_metrics, router.metrics_interval_s)
        # The document sessions as last listed from the store (claimed while it is down).
        self._listed: list[Holding] = []

    async def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant (401 without a valid key), counted against its request rate."""
        try:
            tenant = self.keys.tenant(authorization)
            # Held while this router alone cannot reach the store (`routing/store_reach.py`).
            await held(self.reach, lambda: self.gate.admit(tenant))
        except ServiceError as exc:
            self.metrics.requests.labels(str(exc.status)).inc()
            raise
        return tenant

    # -- background: loads, TTL ------------------------------------------------------------

    def start(self) -> None:
        """What runs beside the requests, on the loop that serves them."""
        self.loop_lag.start()
        self.reach.start()

    def shutdown(self) -> None:
        """Nothing of this router outlives it: its loop monitor, store probes, maintenance
        loop, load calls and PDF workers end."""
        self.loop_lag.stop()
        self.reach.stop()
        self.pdf.close()
        self.fleet.stop()
        if self._background is not None:
            self._background.cancel()

    def _start_background(self) -> None:
        """Start the maintenance loop (loads, TTL, claims) unless it runs."""
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._maintain())

    async def _started(self) -> None:
        """Start the maintenance loop, and learn the replicas before the first placement."""
        self._start_background()
        if not self.fleet.ledger.loads:
            await self.fleet.refresh_loads()

    def _maintenance_steps(self) -> dict[str, Callable[[], Awaitable[object]]]:
        """The maintenance loop's steps by name (`MAINTENANCE_STEPS`, each counted from 0)."""
        return {
            "loads": self._loads.get,
            "expiry": self._expire_documents,
            "holds": self.documents.renew_held,
            "claims": self._claim_documents,
            "idle_copies": self._retire_copies,
            "kv_store": self._kv_store_upkeep.get,
        }

    async def _maintain(self) -> None:
        # Each step on its own: a store that is down must not stop the claims (or the loads).
        # The loads poll on a turn of their own: the other steps call replicas, and a call to
        # an engine that died while the GCS is down waits until a poll takes it for lost
        # (`ReplicaFleet._condemn_silent`), which a turn shared with it would never reach.
        steps = self._maintenance_steps()
        loads = {"loads": steps.pop("loads")}
        polls = asyncio.get_running_loop().create_task(self._maintenance_turns(loads))
        try:
            await self._maintenance_turns(steps)
        finally:
            polls.cancel()

    async def _maintenance_turns(self, steps: dict[str, Callable[[], Awaitable[object]]]) -> None:
        while True:
            for name, step in steps.items():
                await self._maintenance_step(name, step)
            await asyncio.sleep(self.config.router.load_poll_interval_s)

    async def _maintenance_step(self, name: str, step: Callable[[], Awaitable[object]]) -> None:
        """Run one step; a failure is logged and counted (`wim_maintenance_failures_total`),
        and the loop goes on: a step that fails on every turn is seen, not silent."""
        try:
            await step()
        except Exception as exc:
            self.metrics.maintenance_failures.labels(name).inc()
            # A store that is down says so in its message; anything else is a bug to trace.
            trace = not isinstance(exc, ServiceError)
            logger.warning("maintenance step %s failed: %s", name, exc, exc_info=trace)

    async def _claim_documents(self) -> None:
        """Tell every replica which document sessions are bound to it; a replica closes the
        sessions nobody claims within `orphan_timeout_s` (e.g. its router is gone and the store
        was in that router's memory). With a shared store every router claims them all.

        While the store cannot be listed, the sessions of the last listing are claimed: the
        orphan rule is for a router that is gone, not for a store that is down. A session that
        ended meanwhile drops out of the first listing once the store answers again.
        """
        with contextlib.suppress(ServiceError):  # the store is down: keep the last listing
            self._listed = await self.documents.holdings()
        held: dict[str, list[str]] = {replica: [] for replica in self.fleet.ledger.loads}
        for session in self._listed:
            # Copies are claimed like the primary: no replica reaps a copy as an orphan.
            for replica in session.holders:
                if replica in held:
                    held[replica].append(session.session_id)
        timeout = self.config.router.orphan_timeout_s

        async def claim(replica: str, ids: list[str]) -> int:
            # A claim is answered from memory; one that does not come is retried next turn (a
            # replica reaps only after `orphan_timeout_s`), not waited for. The call is made
            # inside the task, so a turn cancelled before it starts leaves no call unawaited.
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                return await self.client.replica(replica).claim(ids, timeout)

        await asyncio.gather(*(claim(r, ids) for r, ids in held.items()), return_exceptions=True)

    async def _retire_copies(self) -> None:
        """Close the copies of hot documents that went idle (`routing/copies.py`), as of the
        last listing of the store."""
        await self.dispatcher.copies.retire_idle(self._listed)

    async def _expire_documents(self) -> None:
        for session in await self.documents.expired():
            logger.debug("document session %s expired", session.session_id)
            await self.dispatcher.close_ended(session)

    # -- jobs ------------------------------------------------------------------------------

    async def _observed(
        self, items: AsyncIterator[Item], tenant: Tenant, lease: JobLease | None
    ) -> AsyncIterator[Item]:
        """`items` under the tenant's job limit (`lease` if taken already) and the request
        deadline, with metrics; the request's status is counted once it ends."""
        observer = JobObserver(self.metrics)
        status: str | None = None  # until the job ends
        deadline = asyncio.get_running_loop().time() + self.config.router.request_timeout_s
        try:
            async with self.gate.job(tenant, lease):
                while (item := await _next_by(deadline, items)) is not None:
                    replica, event = item
                    observer.observe(event)
                    if event.type == "error":
                        status = str(status_of(event.code))
                    elif event.type == "done":
                        status = "200"
                    yield replica, event
        except TimeoutError as exc:
            status = str(status_of(ErrorCode.DEADLINE_EXCEEDED))
            self.fleet.timed_out()
            raise WiMError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the job ran past {self.config.router.request_timeout_s:g} s and was stopped",
            ) from exc
        except ServiceError as exc:
            status = str(exc.status)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The caller left (cancelled in an await, or closed between two events) before the end.
            status = status or str(status_of(ErrorCode.CANCELLED))
            raise
        finally:
            observer.finish(status or "error")

    def _check_size(self, text: str, tenant: Tenant) -> None:
        limit = self.config.router.max_document_chars
        if len(text) > limit:
            raise ServiceError(
                ErrorCode.TOO_LONG,
                f"the document has {len(text)} characters; this service takes at most {limit}",
            )
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > tenant.limits.document_bytes:
            raise ServiceError(
                ErrorCode.TOO_LONG,
                f"the document is {size} bytes; your limit is {tenant.limits.document_bytes}",
            )

    async def _document(self, document_id: str, tenant: Tenant) -> StoredSession:
        """The tenant's live session; another tenant's is as unknown as a missing one."""
        session = await self.documents.get(document_id)
        if session is None or session.tenant != tenant.name:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no document session {document_id!r}")
        return session

    async def start_job(
        self, body: WiMRequest, tenant: Tenant, lease: JobLease | None = None
    ) -> tuple[str, AsyncIterator[Item]]:
        """Start a job: its session id and its events, the first one already produced; it
        runs under `lease`, one of the tenant's jobs taken already, if given.

        Errors before the first event are raised as `ServiceError`; later ones arrive as an
        `error` event, and so does any of a streamed job (`body.stream`) whose first event took
        longer than `stream_heartbeat_s` (`http/responses.py`, `started`). `POST /wim` and the
        OpenAI-compatible API build on this.
        """
        if body.context is not None:
            tenant.require(Capability.JOBS)
            self._check_size(body.context, tenant)
            session_id = "job-" + secrets.token_hex(8)
            record = None
        else:
            tenant.require(Capability.DOCUMENTS)
            record = await self._document(body.document_id or "", tenant)
            check_document_options(record.options, body.options)
            session_id = record.session_id
        await self._started()
        events = self._observed(
            self.dispatcher.job(
                session_id,
                body.query,
                body.options,
                context=body.context,
                record=record,
                tenant=tenant.name,
            ),
            tenant,
            lease,
        )
        return session_id, await started(events, self._streamed_after(body.stream))

    async def start_plain(
        self,
        prompt_ids: list[int],
        params: PlainParams,
        tenant: Tenant,
        lease: JobLease | None = None,
        stream: bool = False,
    ) -> AsyncIterator[Item]:
        """Start one plain completion of `prompt_ids` (no WiM) under `lease` if given: its
        events, errors before the first raised as `ServiceError` (as in `start_job`)."""
        tenant.require(Capability.JOBS)
        await self._started()
        session_id = "plain-" + secrets.token_hex(8)
        events = self._observed(
            self.dispatcher.plain(session_id, prompt_ids, params, tenant.name), tenant, lease
        )
        return await started(events, self._streamed_after(stream))

    def _streamed_after(self, stream: bool) -> float | None:
        return self.config.router.stream_heartbeat_s if stream else None  # `started`'s wait

    # -- documents -------------------------------------------------------------------------

    async def create_document(self, body: DocumentRequest, tenant: Tenant) -> DocumentResponse:
        tenant.require(Capability.DOCUMENTS)
        self._check_size(body.context, tenant)
        await self._started()
        router = self.config.router
        ttl = min(body.ttl_s or router.session_ttl_s, router.max_session_ttl_s)
        new = StoredSession("doc-" + secrets.token_hex(12), body.options, ttl, tenant=tenant.name)
        status = "error"
        try:
            async with self.gate.opening(new, tenant, self.fleet.session_capacity()):
                session = await self.dispatcher.open_document(new, body.context)
            self.metrics.binding.labels(BindResult.NEW).inc()
            status = "201"
        except ServiceError as exc:
            status = str(exc.status)
            raise
        finally:
            self.metrics.requests.labels(status).inc()
        return document_response(session)

    async def get_document(self, document_id: str, tenant: Tenant) -> DocumentResponse:
        return document_response(await self._document(document_id, tenant))

    async def delete_document(self, document_id: str, tenant: Tenant) -> None:
        await self._document(document_id, tenant)
        if not await self.dispatcher.close_document(document_id):
            raise ServiceError(ErrorCode.NOT_FOUND, f"no document session {document_id!r}")

    # -- health and metrics ----------------------------------------------------------------

    async def ready_replicas(self) -> list[str]:
        # Readiness probes come first: from here on the loads are polled in the background.
        self._start_background()
        await self._loads.get()
        return self.fleet.ready()

    async def metrics_text(self) -> str:
        """This router's metrics, as of a render that started after the call, with the engine
        replicas' (`Recent`): one render per `metrics_interval_s` for every scraper (`Paced`)."""
        return await self._metrics_page.get()

    async def _render_metrics(self) -> str:
        texts = await self._replica_metrics.get()
        self.metrics.metrics_renders.inc()
        # The router's own samples are copied on the loop that updates them (a gauge cleared
        # and set again is never seen half done); parsing the replicas' texts, tens of
        # milliseconds each, and the page's text are made off it.
        own = list(self.metrics.registry.collect())
        return await asyncio.to_thread(merge_replica_metrics, own, texts)

    async def _fetch_replica_metrics(self) -> dict[str, str]:
        async def text_of(replica: str) -> str:
            async with asyncio.timeout(10):
                return await self.client.replica(replica).metrics_text()

        replicas = sorted(self.fleet.ledger.loads)
        texts = await asyncio.gather(*map(text_of, replicas), return_exceptions=True)
        return {r: t for r, t in zip(replicas, texts, strict=True) if isinstance(t, str)}


async def _next_by(deadline: float, items: AsyncIterator[Item]) -> Item | None:
    """The next item (None at the end); TimeoutError past `deadline`. Timed per step, not across
    a yield: `asyncio.timeout` cancels the task that entered it, and a stream's steps may each
    run in a task of their own (`http/keepalive.py`)."""
    async with asyncio.timeout_at(deadline):
        return await next_or_none(items)


def _serve_http_host() -> str:
    """The address Serve's HTTP proxies listen on (asked of the Serve controller)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    http_config: Any = ray.get(controller.get_http_config.remote())
    return str(http_config.host)


def _replica_name() -> str:
    """This router's Serve replica id (sent as `X-WiM-Router`); "local" outside Serve."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not in a Serve replica (tests, in-process use)
        return "local"
