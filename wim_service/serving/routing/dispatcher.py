"""Dispatching work to the engine replicas: the replica a job or a document query runs on.

`Dispatcher` sends one-shot jobs, plain requests and document-session queries to their replica
over an injected `ReplicaClient` (a query to the primary or a copy of its document,
`copies.py`). When the replica is lost mid-call, the job is retried on the same replica if it
was unreachable for a moment, else failed over: a one-shot job is placed elsewhere, a document
session is moved off the replica (`failover.py`: to a live copy, or rebuilt elsewhere), and the
call is retried. A streamed job does not repeat what it already delivered (`StreamProgress`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from wim_service.placement.ledger import Booking
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.http.responses import Item
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient, ReplicaLost
from wim_service.serving.replica.plain import PlainParams, plain_blocks
from wim_service.serving.replica.watch import ReplicaSilent
from wim_service.serving.replica.work import one_shot_work, plain_work
from wim_service.serving.routing.bindings import BindResult
from wim_service.serving.routing.copies import DocumentCopies, HolderChoice, close_on, query_work
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.failover import SessionFailover, SessionMissing, session_gone
from wim_service.serving.routing.fleet import ReplicaFleet
from wim_service.serving.routing.prefixes import prompt_blocks
from wim_service.serving.routing.progress import StreamProgress
from wim_service.serving.routing.quotas import TenantGate
from wim_service.serving.routing.sizing import JobSizer
from wim_service.serving.routing.stored_kv import StoredKV
from wim_service.serving.store import StoredSession
from wim_service.wim.errors import ErrorCode, WiMError, logged_failure
from wim_service.wim.events import DoneEvent, ErrorEvent, WiMEvent
from wim_service.wim.options import WiMOptions

logger = logging.getLogger(__name__)

# A replica that Ray cannot reach for a moment is retried this often before it is given up.
# Once, soon: a lost node's actors stay "unavailable" (not dead) until the GCS has missed its
# health checks, and every retry until then delays the failover of the requests it held; a
# replica given up too early costs one document read elsewhere, and its stale session is
# purged when it is reachable again (tests/multinode/test_multinode.py's partition).
TRANSIENT_RETRIES = 1
TRANSIENT_BACKOFF_S = 0.25


@dataclass
class _Job:
    """One job's attempts so far: where it runs, what it delivered, what it tried."""

    session_id: str
    record: StoredSession | None  # the document session queried; None for a one-shot job
    subject: str  # what log lines name the job by
    progress: StreamProgress = field(default_factory=StreamProgress)
    replica: str | None = None  # a one-shot job's placement (None: place it anew)
    booking: Booking | None = None  # what this attempt booked on its replica's load
    exclude: set[str] = field(default_factory=set)  # replicas lost by this job
    failovers: int = 0
    transient_retries: int = 0
    copy_lease: str | None = None  # held in the store while this attempt runs on a copy
    cost: float | None = None  # what cheapest-first admission admitted it at (`fleet.admit`)
    tenant: str | None = None  # whose job: a reclaim for it closes only its copies if over


class Dispatcher:
    def __init__(
        self,
        client: ReplicaClient,
        fleet: ReplicaFleet,
        documents: DocumentTable,
        sizer: JobSizer,
        config: RouterConfig,
        metrics: WiMMetrics,
        gate: TenantGate,
    ) -> None:
        self.client = client
        self.fleet = fleet
        self.documents = documents
        self.sizer = sizer
        self.config = config
        self.metrics = metrics
        self.copies = DocumentCopies(client, fleet, documents, config, metrics, gate)
        self.failover = SessionFailover(
            client, fleet, documents, sizer, metrics, reclaim=self.copies.reclaim
        )
        self.stored_kv = StoredKV.from_env(metrics)

    # -- document sessions -----------------------------------------------------------------

    async def open_document(self, session: StoredSession, text: str) -> StoredSession:
        """Read a new document on a replica with room and store its session, bound there.
        Nothing of a read that fails stays in the KV store: no session names it."""
        try:
            replica, opened, blocks = await self.failover.read(session, text, set(), fresh=True)
        except BaseException:
            await asyncio.shield(self.stored_kv.delete(session.tenant, session.session_id))
            raise
        try:
            return await self.documents.add(
                replace(
                    session,
                    replica=replica,
                    context_tokens=opened.context_tokens,
                    segments=opened.segments,
                    kv_blocks=blocks,
                ),
                text,
            )
        except ServiceError:
            # Not stored (the store is down): no KV may stay pinned for a session nobody has.
            await close_on(self.client, replica, session.session_id)
            await self.stored_kv.delete(session.tenant, session.session_id)
            raise

    async def close_document(self, document_id: str) -> bool:
        """End a session for every router at once (DELETE); False if there was none. Its
        tombstone stops any failover in flight from binding it again."""
        ended = await self.documents.remove(document_id)
        if ended is not None:
            await self.close_ended(ended)
        return ended is not None

    async def close_ended(self, session: StoredSession) -> None:
        """Free an ended session's KV on every replica holding it, and in the KV store."""
        await asyncio.gather(
            *(close_on(self.client, replica, session.session_id) for replica in session.holders),
            self.stored_kv.delete(session.tenant, session.session_id),
        )

    async def document_replica(
        self, document_id: str, query: str, options: WiMOptions
    ) -> HolderChoice:
        """The replica a query of the document runs on (its primary, or a copy: `copies.py`),
        counted as running there until `copies.end`, and what it booked there; or a new copy
        to read first (`HolderChoice.copy_of`: `DocumentCopies.read_copy`). A session whose
        primary is gone is taken over by a live copy, or rebuilt elsewhere, then placed on
        its holders as any query (`wim sim` models a lost replica so too). The store
        decides: another router may have moved or ended the session. Called under the
        session's lock."""
        moved = False  # a failover moved the session: its binding counted as a repin
        while True:
            session = await self.documents.get(document_id)
            if session is None:
                raise session_gone(document_id)
            session = await self.failover.drop_lost_copies(session)
            primary = session.replica
            if primary is None or not self.fleet.ledger.is_live(primary):
                # Then placed on its holders as they are now, and booked there, as any query.
                if primary is None:
                    await self.failover.rebuild(session, "session_lost")
                else:
                    await self.failover.lose(session, primary, "replica_left")
                moved = True
                continue
            if not moved:
                self.metrics.binding.labels(BindResult.HIT).inc()
            choice = await self.copies.holder(session, query, options)
            if choice.copy_of is None:
                self.copies.begin(document_id, choice.replica, primary=choice.replica == primary)
            return choice

    # -- jobs ------------------------------------------------------------------------------

    async def job(
        self,
        session_id: str,
        query: str,
        options: WiMOptions,
        *,
        context: str | None = None,
        record: StoredSession | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[Item]:
        """Events of one job as (replica, event), failing over when its replica is lost.

        A one-shot job (`context`, of `tenant` if known) is placed under `session_id` and
        unbound when it ends; a query on a document session (`record`) goes to the session's
        replica, and holds the session (no TTL ends it) while it runs.
        """
        cost = None
        if record is not None:
            cost = self.fleet.first_query(record.session_id)
            if cost is None:
                cost = self.fleet.admit(query_work(record, query, options))
            await self.documents.hold(record.session_id)
        job = _Job(
            session_id,
            record,
            # What log lines name the job by: a document id stays out of logs (docs/security.md).
            session_id if record is None else "a document query",
            tenant=record.tenant if record is not None else tenant,
            cost=cost,
        )
        try:
            async for item in self._attempts(job, query, options, context):
                self._answered(job.cost, item)
                yield item
        finally:
            if record is None:
                self.fleet.ledger.unbind(session_id)
            else:
                await self.documents.release(record.session_id)

    async def plain(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: PlainParams,
        tenant: str | None = None,
    ) -> AsyncIterator[Item]:
        """Events of one plain engine request (`serving/replica/plain.py`) of `tenant` (if
        known), placed like a one-shot job under `session_id` and unbound when it ends. Not
        failed over: a short prompt is cheap for its client to send again, and part of its
        answer may be out already."""
        block = self.sizer.limits.block_size
        needed = plain_blocks(len(prompt_ids), params, block)
        # Its prefix as the engine caches it: the policy sends a repeated long prefix back to
        # the replica holding it unless that replica is busier than recomputing it elsewhere.
        prefix = prompt_blocks(prompt_ids, block, params.cache_salt)
        work = plain_work(
            len(prompt_ids), params.max_tokens, needed, prefix=prefix, block_tokens=block
        )
        cost = self.fleet.admit(work)
        reclaim = functools.partial(self.copies.reclaim, tenant)
        booking = await self.fleet.place(session_id, work, reclaim=reclaim)
        replica = booking.replica
        self.metrics.binding.labels(BindResult.NEW).inc()
        try:
            async for event in self.client.replica(replica).complete(prompt_ids, params):
                self._answered(cost, (replica, event))
                yield replica, event
        except WiMError as exc:
            self.fleet.refused_by_replica(exc.code)
            raise
        except ReplicaLost as exc:
            self.fleet.lost(replica, "replica_lost")
            raise logged_failure(
                ErrorCode.UNAVAILABLE,
                "the engine replica running this request was lost; send the request again",
                exc,
                session_id,
                retry_after_s=self.config.retry_after_s,
            ) from exc
        finally:
            self.fleet.ledger.done(booking)
            self.fleet.ledger.unbind(session_id)

    async def _attempts(
        self, job: _Job, query: str, options: WiMOptions, context: str | None
    ) -> AsyncIterator[Item]:
        while True:
            job.progress.new_attempt()
            replica, events = await self._start_attempt(job, query, options, context)
            try:
                async for event in events:
                    self._check_event(job, replica, event)
                    if job.progress.fresh(event):
                        yield replica, event
                return
            except WiMError as exc:
                self.fleet.refused_by_replica(exc.code)
                raise
            except (ServiceError, asyncio.CancelledError):
                raise
            except ReplicaLost as exc:
                await self._recover(job, replica, exc)
            except Exception as exc:  # a bug or engine fault on the replica: not retried
                raise logged_failure(
                    ErrorCode.ENGINE_ERROR,
                    "the engine failed on this request",
                    exc,
                    f"{job.subject} on replica {replica}",
                ) from exc
            finally:
                self._attempt_ended(job, replica)
                if job.copy_lease is not None:
                    lease, job.copy_lease = job.copy_lease, None
                    await self.copies.release(job.session_id, replica, lease)

    def _attempt_ended(self, job: _Job, replica: str) -> None:
        if job.booking is not None:
            # Its work ended: it stops counting on the replica before the next load report.
            self.fleet.ledger.done(job.booking)
            job.booking = None
        if job.record is not None:
            self.copies.end(job.session_id, replica)

    async def _start_attempt(
        self, job: _Job, query: str, options: WiMOptions, context: str | None
    ) -> tuple[str, AsyncIterator[WiMEvent]]:
        """The replica of this attempt and its events: the document's replica (rebuilt there
        if it was lost), or the one-shot job's, placed anew after a failover."""
        if job.record is not None:
            async with self.documents.lock(job.session_id):
                choice = await self.document_replica(job.session_id, query, options)
            if choice.copy_of is not None:
                choice = await self.copies.read_copy(choice)
            replica, job.booking = choice.replica, choice.booking
            job.copy_lease = await self.copies.lease(job.record, replica)
            events = self.client.replica(replica).query_document(job.session_id, query, options)
            return replica, events
        if job.replica is None:
            shape = await self.sizer.shape(context or "", options, query)
            blocks = self.sizer.blocks(shape, one_shot=True)
            work = one_shot_work(shape.context_tokens, shape.segments, blocks, options, query)
            if not job.failovers:  # an arrival; its failovers were admitted with it
                job.cost = self.fleet.admit(work)
            # No room: spare copies are closed; only the tenant's own if it is over its share.
            reclaim = functools.partial(self.copies.reclaim, job.tenant)
            job.booking = await self.fleet.place(job.session_id, work, job.exclude, reclaim=reclaim)
            job.replica = job.booking.replica
            self.metrics.binding.labels(BindResult.REPIN if job.failovers else BindResult.NEW).inc()
        return job.replica, self.client.replica(job.replica).run(context or "", query, options)

    def _answered(self, cost: float | None, item: Item) -> None:
        """Count a job's answer in admission's books once its `done` event passes, with its
        time on the engine as the replica measured it (its wait for admission left out)."""
        event = item[1]
        if isinstance(event, DoneEvent):
            self.fleet.answered(cost, event.timings.total_s - event.timings.queue_s)

    def _check_event(self, job: _Job, replica: str, event: WiMEvent) -> None:
        if isinstance(event, ErrorEvent):
            self.fleet.refused_by_replica(event.code)
        if job.record is not None and (
            isinstance(event, ErrorEvent) and event.code == ErrorCode.NOT_FOUND.value
        ):
            # The replica no longer has this session (restarted, or another router closed
            # that copy): rebuild it.
            raise SessionMissing(replica, LookupError(event.message))
        if isinstance(event, ErrorEvent) and event.code == ErrorCode.ENGINE_ERROR:
            # The replica logged the failure under the incident id its message names; this
            # line ties that id to the job and the replica.
            logger.warning("%s: replica %s: %s", job.subject, replica, event.message)

    async def _recover(self, job: _Job, replica: str, exc: ReplicaLost) -> None:
        """After `replica` was lost: retry it if it was unreachable for a moment, else fail
        the job over (its session rebuilt or placed elsewhere), up to `max_failovers`."""
        if exc.transient and job.transient_retries < TRANSIENT_RETRIES:
            # Unreachable for a moment is not gone: try the same replica again.
            job.transient_retries += 1
            logger.warning("replica %s unreachable (%s); retrying", replica, exc)
            await asyncio.sleep(TRANSIENT_BACKOFF_S * job.transient_retries)
            return
        job.failovers += 1
        if job.failovers > self.config.max_failovers:
            # Lost replicas, not a bad request: the client may send it again (503).
            raise logged_failure(
                ErrorCode.UNAVAILABLE,
                "engine replicas kept failing on this request; retry later",
                exc,
                job.subject,
                retry_after_s=self.config.retry_after_s,
            ) from exc
        missing = isinstance(exc, SessionMissing)
        if missing:
            logger.warning("replica %s does not hold the session; rebuilding it", replica)
        else:
            logger.warning("replica %s lost mid-request (%s); failing over", replica, exc)
        if job.record is not None:
            async with self.documents.lock(job.session_id):
                current = await self.documents.get(job.session_id)
                if current is not None and replica in current.holders:
                    await self.failover.lose(current, replica, _reason(exc), alive=missing)
        else:
            self.fleet.lost(replica, _reason(exc))
            job.exclude.add(replica)
            self.fleet.ledger.unbind(job.session_id)
            job.replica = None


def _reason(exc: ReplicaLost) -> str:
    """The failover's reason as `wim_session_failover_total` counts it."""
    if isinstance(exc, SessionMissing):
        return "session_missing"
    # Its calls ended because it answered no load call (`ReplicaFleet._condemn_silent`).
    return "replica_silent" if isinstance(exc, ReplicaSilent) else "replica_lost"
