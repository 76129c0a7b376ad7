"""Moving a document session off a replica that no longer holds it.

When a session's replica is lost or leaves (or answers that it forgot the session), a copy
there is dropped; a primary there is replaced by a live copy of the document (no re-read), or
the session is rebuilt on another replica from its text and bound there by compare-and-set in
the session store, since another router may have moved or ended it meanwhile. `Dispatcher`
(`dispatcher.py`) decides when; `SessionFailover` does the move, and the document reads that a
new session and a rebuild share (a read retried elsewhere if its replica dies).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from wim_service.serving.errors import ServiceError
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient, ReplicaLost
from wim_service.serving.replica.contracts import DocumentOpened
from wim_service.serving.replica.work import session_work
from wim_service.serving.routing.bindings import BindResult
from wim_service.serving.routing.copies import close_on, close_unless_held
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.fleet import ReplicaFleet
from wim_service.serving.routing.sizing import JobSizer
from wim_service.serving.store import StoredSession
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import ErrorEvent

logger = logging.getLogger(__name__)


class SessionMissing(ReplicaLost):
    """The replica answered that it does not hold the session (it restarted, or another
    router closed that copy): the session is rebuilt, but the replica is not lost. Taking it
    for lost would stop placing work there, and with no other replica up a failover would
    then wait `replica_wait_s` for one."""


def session_gone(document_id: str) -> ServiceError:
    return ServiceError(ErrorCode.NOT_FOUND, f"no document session {document_id!r}")


class SessionFailover:
    def __init__(
        self,
        client: ReplicaClient,
        fleet: ReplicaFleet,
        documents: DocumentTable,
        sizer: JobSizer,
        metrics: WiMMetrics,
        reclaim: Callable[[str | None], Awaitable[int]],
    ) -> None:
        self.client = client
        self.fleet = fleet
        self.documents = documents
        self.sizer = sizer
        self.metrics = metrics
        self.reclaim = reclaim  # closes spare copies (of a tenant's, `DocumentCopies.reclaim`)

    async def read(
        self, session: StoredSession, text: str, exclude: set[str], *, fresh: bool = False
    ) -> tuple[str, DocumentOpened, int]:
        """Read the document on a replica with room, retried elsewhere if one dies: there,
        what was read, and the KV blocks the session reserves. The replica saves the
        document's KV as it reads it (with a KV store); a read that is not `fresh` (a rebuild)
        restores it from there when it was saved.

        A read whose caller goes away is cancelled on the replica (`ReplicaClient.call`), which
        stops it unless another caller shares it (`HeldDocuments.open`). A `fresh` document's
        id is known to nobody else, so what the replica finished reading before the cancel
        reached it is closed too, before the tenant's reservation of it goes back."""
        shape = await self.sizer.shape(text, session.options, None)
        blocks = self.sizer.blocks(shape, one_shot=False)
        if fresh:  # a new session opens as its first query, not yet asked, is admitted
            first = session_work(
                session.session_id,
                shape.context_tokens,
                blocks,
                session.options,
                query="",
                segments=shape.segments,
            )
            self.fleet.admit(first, opens=session.session_id)
        work = session_work(
            session.session_id, shape.context_tokens, blocks, session.options, restorable=not fresh
        )
        # No room: spare copies are closed; only the tenant's own if it is over its fair share.
        reclaim = functools.partial(self.reclaim, session.tenant)
        while True:
            booking = await self.fleet.place(None, work, exclude, reclaim=reclaim)
            replica = booking.replica
            try:
                result = await self.client.replica(replica).open_document(
                    session.session_id, text, session.options, session.tenant, not fresh
                )
            except ReplicaLost:
                self.fleet.ledger.cancel(booking)
                self.fleet.lost(replica, "replica_lost")
                exclude.add(replica)
                continue
            except asyncio.CancelledError:
                self.fleet.ledger.cancel(booking)
                if fresh:
                    await asyncio.shield(close_on(self.client, replica, session.session_id))
                raise
            if isinstance(result, ErrorEvent):
                self.fleet.ledger.cancel(booking)
                self.fleet.refused_by_replica(result.code)
                raise ServiceError(result.code, result.message, result.retry_after_s)
            assert isinstance(result, DocumentOpened)
            # Read: a query placed next must not wait behind it.
            self.fleet.ledger.done(booking)
            return replica, result, blocks

    async def drop_lost_copies(self, session: StoredSession) -> StoredSession:
        """`session` without its copies on replicas that are gone (dropped from the store)."""
        lost = [r for r in session.copies if not self.fleet.ledger.is_live(r)]
        for replica in lost:
            await self.documents.drop_copy(session.session_id, replica)
        return replace(session, copies=tuple(r for r in session.copies if r not in lost))

    async def lose(
        self, session: StoredSession, replica: str, reason: str, *, alive: bool = False
    ) -> None:
        """`replica` no longer holds `session` (lost, or `alive` but without it): a copy there
        is dropped; a primary there is replaced by a live copy (no re-read) or the session is
        rebuilt (elsewhere, unless the replica is alive). Callers read the session's new
        holders from the store: another router may have moved or ended it meanwhile."""
        if alive:
            self.metrics.failover.labels(reason).inc()
        else:
            self.fleet.lost(replica, reason)
        document_id = session.session_id
        if replica != session.replica:
            await self.documents.drop_copy(document_id, replica)
            return
        ledger = self.fleet.ledger
        copy = next((r for r in session.copies if r != replica and ledger.is_live(r)), None)
        if copy is None:
            await self.rebuild(session, reason, exclude=set() if alive else {replica})
            return
        if not await self.documents.rebind(document_id, replica, copy, promote=True):
            return
        self.metrics.binding.labels(BindResult.REPIN).inc()
        logger.info("a document session's copy on %s took over from %s (%s)", copy, replica, reason)

    async def rebuild(
        self, session: StoredSession, reason: str, exclude: set[str] | None = None
    ) -> None:
        """Rebuild the session on a replica (not one in `exclude`; by default not its own),
        then bind it there by compare-and-set; if another router moved or ended it first, the
        copy read here is closed again, unless the session is held there."""
        old, document_id = session.replica, session.session_id
        text = await self.documents.text(document_id)
        if text is None:
            raise session_gone(document_id)
        if exclude is None:
            exclude = {old} if old else set()
        replica, opened, _ = await self.read(session, text, exclude)
        try:
            moved = await self.documents.rebind(document_id, old, replica)
        except ServiceError:
            await close_on(self.client, replica, document_id)
            raise
        if not moved:
            await close_unless_held(self.client, self.documents, replica, document_id)
            return
        self.metrics.binding.labels(BindResult.REPIN).inc()
        # What was read again: nothing if the document's KV was restored. A restore still
        # computes what its stored blocks do not hold (at least the tail past the last whole
        # block), and that is the restore's, not a re-read (docs/kv-store.md).
        if not opened.restored_tokens:
            self.metrics.reprefill_tokens.inc(opened.context_tokens)
        # Document ids stay out of logs at the default level (they name customers' data).
        logger.info("a document session moved %s -> %s (%s)", old, replica, reason)
