"""Copies of hot documents: one document session's queries shared between replicas.

A document session is read on one replica (its primary). When the placement policy expects a
query to start sooner on a replica without the document than on any replica holding it (the
holders are busy; reading another copy is quicker), the router reads a copy there
(`open_document` with the session's text and options: the replica gives each open its own
cache salt), records it in the session store (`add_copy`, within `max_copies` holders) and
sends the query there. Later queries go to the holder with the least expected wait.

The read takes seconds on a real engine, and it happens outside the session's lock
(`HolderChoice.copy_of`, then `read_copy`): the session's other queries start on its holders
meanwhile. Held under the lock, it kept them all waiting for the read, on exactly the documents
copies are for (docs/routing.md). While this router reads a copy of a document, its other
queries do not open a second one (`_opening`); across routers the store's `add_copy` bounds
the holders.

A copy costs a whole document read, so it is opened on fresh evidence only: the loads the
policy weighed may be a poll interval old, and a holder's report taken while a query ran
(this router's or another's) still counts that query after it ended. Before a copy opens, the
replicas' loads are asked again (`ReplicaFleet.fresh_loads`: at most once per
`FRESH_LOADS_S`, whatever the number of queries deciding at once) and the query placed again
on them, by a policy that weighs loads (round robin would only take another turn): the steps
`wim sim` takes too (`placement.copies.QuerySteps`).

Copies are part of the session: DELETE and expiry close every one, and every router claims
them like the primary, so that no replica reaps one as an orphan. A copy that no query of this
router used for `copy_idle_s` is closed (`retire_idle`): never the primary, never while a
query of this router runs on it. When no replica has room for new work (a new session, a
one-shot job), the copies no query of this router runs on are closed at once (`reclaim`,
before the router answers 429): in `wim sim` of an overloaded document trace, new sessions
otherwise queued behind copies that sat idle (docs/routing.md).
Idleness is judged across routers: a query on a copy holds a lease on it in the session store
(`lease`), and the store drops a copy only if no router's query holds it or used it within
the idle time (`drop_copy(..., idle_s=...)`), so no router closes a copy another one is
reading. A copy is on its document's tenant's books: it opens only within the tenant's
session slots (`TenantGate.copy_slots`), and a reclaim for a tenant over its fair share closes
only that tenant's copies (`TenantGate.reclaim_scope`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

from wim_service.placement.copies import CopyBook, QuerySteps
from wim_service.placement.ledger import Booking
from wim_service.placement.state import Work
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient, ReplicaLost
from wim_service.serving.replica.contracts import DocumentOpened
from wim_service.serving.replica.work import session_work
from wim_service.serving.routing.documents import DocumentTable
from wim_service.serving.routing.fleet import ReplicaFleet
from wim_service.serving.routing.quotas import TenantGate
from wim_service.serving.store import Holding, StoredSession
from wim_service.wim.options import WiMOptions

logger = logging.getLogger(__name__)


async def close_on(client: ReplicaClient, replica: str, document_id: str) -> None:
    """Close a document's KV on one replica, as far as it can be reached: a replica that
    cannot be reached reaps the session itself once no router claims it there."""
    with contextlib.suppress(Exception):
        await client.replica(replica).close_document(document_id)


async def close_unless_held(
    client: ReplicaClient, documents: DocumentTable, replica: str, document_id: str
) -> None:
    """Close a read of this router's that it could not record, unless the session store
    records a holder of the session on that replica: a replica reads a document once
    (`HeldDocuments.open`), so this read may be the very session another router recorded."""
    current = await documents.get(document_id)
    if current is None or replica not in current.holders:
        await close_on(client, replica, document_id)


@dataclass(frozen=True)
class HolderChoice:
    """Where a query of a document session runs, and what it booked there."""

    replica: str
    booking: Booking | None
    # `replica` holds no copy yet: read one there first (`DocumentCopies.read_copy`, outside
    # the session's lock), or run on `fallback` if that fails.
    copy_of: StoredSession | None = None
    fallback: str = ""


def query_work(session: StoredSession, query: str, options: WiMOptions) -> Work:
    """A query of `session` as placement and admission see it."""
    return session_work(
        session.session_id,
        session.context_tokens,
        session.kv_blocks,
        options,
        query=query,
        segments=session.segments,
    )


class DocumentCopies:
    def __init__(
        self,
        client: ReplicaClient,
        fleet: ReplicaFleet,
        documents: DocumentTable,
        config: RouterConfig,
        metrics: WiMMetrics,
        gate: TenantGate,
    ) -> None:
        self.client = client
        self.fleet = fleet
        self.documents = documents
        self.config = config
        self.gate = gate  # the tenants' books: copies' slots, and whose copies a reclaim takes
        # Each listed or opened document's tenant, and each tenant's session slots (sessions
        # and their copies) as of the last listing of the store.
        self._tenants: dict[str, str] = {}
        self._slots: dict[str, int] = {}
        self.metrics = metrics
        # This router's queries running on each holder, and when one last ran on each copy.
        self.book = CopyBook()
        # Documents this router is reading a copy of (see above).
        self._opening: set[str] = set()

    async def holder(self, session: StoredSession, query: str, options: WiMOptions) -> HolderChoice:
        """The holder a query of `session` (its primary live) runs on, by the policy, with
        the query's booking there (`Ledger.done` once it ends); or a replica to read a new
        copy on first (`copy_of`). Called under the session's lock."""
        ledger = self.fleet.ledger
        holders = [r for r in session.holders if ledger.is_live(r)]
        steps = QuerySteps(ledger, query_work(session, query, options))
        while steps.place(holders):
            await self.fleet.fresh_loads.get()
            holders = [r for r in holders if ledger.is_live(r)]
        opening = session.session_id in self._opening
        booking = steps.settle(holders, self.config.max_copies, opening)
        home = session.replica or holders[0]
        if booking is None:
            return HolderChoice(home, None)
        if not booking.placement.open_copy:
            return HolderChoice(booking.replica, booking)
        self._opening.add(session.session_id)
        return HolderChoice(booking.replica, booking, copy_of=session, fallback=home)

    async def read_copy(self, choice: HolderChoice) -> HolderChoice:
        """Read the copy `choice` asks for and record it (without the session's lock: the
        session's other queries start on its holders meanwhile); the choice settled on the
        copy, or on its fallback if the copy could not be read or recorded, and the query
        counted as running there (`begin`)."""
        session, booking, ledger = choice.copy_of, choice.booking, self.fleet.ledger
        assert session is not None and booking is not None
        try:
            opened = await self._open(session, choice.replica)
        except BaseException:
            ledger.cancel(booking)
            raise
        finally:
            self._opening.discard(session.session_id)
        if opened:
            # Read: the query's own part of the booking stays.
            ledger.done(booking, ledger.profile.read_seconds(session.context_tokens, saved=True))
            settled = HolderChoice(choice.replica, booking)
        else:
            ledger.cancel(booking)  # nothing read or kept there
            settled = HolderChoice(choice.fallback, None)
        primary = settled.replica == session.replica
        self.begin(session.session_id, settled.replica, primary=primary)
        return settled

    async def _open(self, session: StoredSession, replica: str) -> bool:
        """Read a copy of the session's document on `replica` and record it; False if it
        could not be read or recorded (nothing of it is left open then)."""
        document_id = session.session_id
        text = await self.documents.text(document_id)
        if text is None:
            return False
        try:
            # Restored from the KV store when the document's KV was saved (docs/kv-store.md).
            opened = await self.client.replica(replica).open_document(
                document_id, text, session.options, session.tenant, True
            )
        except ReplicaLost:
            self.fleet.lost(replica, "replica_lost")
            return False
        if not isinstance(opened, DocumentOpened):  # e.g. its KV filled meanwhile
            return False
        try:
            # Its slot and KV are on the tenant's books: within the tenant's own slots.
            slots = self.gate.copy_slots(session.tenant)
            added = await self.documents.add_copy(
                document_id, replica, self.config.max_copies, slots
            )
        except ServiceError:
            await close_on(self.client, replica, document_id)
            raise
        if not added:  # another router reached the limit or read it first, or it ended
            await close_unless_held(self.client, self.documents, replica, document_id)
            return False
        self.metrics.copies_opened.inc()
        self.book.opened(document_id, replica, time.monotonic())
        self._tenants[document_id] = session.tenant
        logger.info("a document session got a copy on %s", replica)
        return True

    def begin(self, document_id: str, replica: str, *, primary: bool) -> None:
        """A query of this router starts on a holder (under the session's lock)."""
        self.book.begin(document_id, replica)
        self.metrics.copy_queries.labels("primary" if primary else "copy").inc()

    def end(self, document_id: str, replica: str) -> None:
        self.book.end(document_id, replica, time.monotonic())

    async def lease(self, session: StoredSession, replica: str) -> str | None:
        """Hold the copy on `replica` in the store while a query of this router runs on it,
        so that no router retires or reclaims it meanwhile: the lease to give back
        (`release`), or None if `replica` holds the primary or no longer a copy."""
        if replica == session.replica:
            return None  # a primary is never retired
        lease = secrets.token_hex(8)
        held = await self.documents.lease_copy(session.session_id, replica, lease)
        return lease if held else None

    async def release(self, document_id: str, replica: str, lease: str) -> None:
        await self.documents.release_copy(document_id, replica, lease)

    async def retire_idle(self, sessions: list[Holding]) -> None:
        """Close the copies idle for `copy_idle_s` among `sessions` (the store's listing)."""
        self._tenants = {s.session_id: s.tenant for s in sessions}
        self._slots = {}
        for s in sessions:
            self._slots[s.tenant] = self._slots.get(s.tenant, 0) + 1 + len(s.copies)
        # A copy first seen here (another router opened it) is idle from now on.
        self.book.listed([(s.session_id, r) for s in sessions for r in s.copies], time.monotonic())
        await self._retire(self.config.copy_idle_s)

    async def reclaim(self, tenant: str | None = None) -> int:
        """Close every copy no router's query holds, however recently used: no replica has
        room for new work (of `tenant`, if known), and a spare copy's KV and session slot
        serve it better than its document's next query (which its other holders take). For
        a tenant over its fair share only its own copies: room for it is never taken from
        another tenant. The number closed."""
        only = self.gate.reclaim_scope(tenant, self._slots, self.fleet.session_capacity())
        return await self._retire(0.0, only)

    async def _retire(self, idle_s: float, only: str | None = None) -> int:
        """Close the copies unused for `idle_s` by this router (`CopyBook.spare`; only tenant
        `only`'s if given) and, as the store judges, by every router. The number closed on
        live replicas."""
        retired = 0
        spare = self.book.spare(time.monotonic(), idle_s, tenants=self._tenants, only=only)
        for document_id, replica in spare:
            lock = self.documents.lock(document_id)
            # A query of this router is starting on the session (or a failover rebuilding
            # it holds its lock while it places work, and may be what asked to reclaim).
            if lock.locked():
                continue
            # Under the session's lock: no query of this router starts on it meanwhile.
            async with lock:
                key = (document_id, replica)
                if self.book.running(document_id, replica) or key not in self.book:
                    continue
                if not await self.documents.drop_copy(document_id, replica, idle_s=idle_s):
                    continue
                self.book.closed(document_id, replica)  # a listing may have dropped it
                if self._lost(replica):
                    continue  # gone with its room: closing it frees none
                await close_on(self.client, replica, document_id)
                self.metrics.copies_retired.inc()
                retired += 1
        self.metrics.document_copies.set(len(self.book))
        return retired

    def _lost(self, replica: str) -> bool:
        """Whether `replica` is known to be gone: the router has heard from the fleet, and
        not that it is live."""
        ledger = self.fleet.ledger
        return bool(ledger.live) and not ledger.is_live(replica)
