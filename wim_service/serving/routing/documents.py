"""Document sessions: what every router shares through the session store (`serving/store/`:
the text, to rebuild a session anywhere; the options fixed when it was read; its tenant, replica
binding and expiry), and what only this router knows (the queries it runs on each session).

With the Redis store any router serves any session, a DELETE through one router is seen by all
at once, and a restarted router loses none. A store that cannot be reached answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar
from weakref import WeakValueDictionary

from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.http.bodies import DocumentResponse
from wim_service.serving.store import (
    Holding,
    SessionStore,
    StoredSession,
    StoreUnavailable,
    reachable,
)
from wim_service.wim.options import WiMOptions

T = TypeVar("T")

# Options that shape a document's KV: fixed when the document is read.
DOCUMENT_FIELDS = ("segment_tokens", "max_segment_tokens")
DOCUMENT_PROMPTS = ("system", "document")


def document_response(session: StoredSession) -> DocumentResponse:
    return DocumentResponse(
        document_id=session.session_id,
        context_tokens=session.context_tokens,
        segments=session.segments,
        expires_at=session.expires_at,
        replica=session.replica or "",
    )


def check_document_options(fixed: WiMOptions, asked: WiMOptions) -> None:
    """A query may change per-query options only; those that shaped the KV are refused."""
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
        raise ServiceError(
            ServiceCode.OPTIONS_FIXED,
            f"{', '.join(changed)} were fixed when the document was read; "
            "upload the document again to change them",
        )


class DocumentTable:
    """The document sessions in the session store, and this router's queries on them."""

    def __init__(self, store: SessionStore, *, hold_s: float, retry_after_s: float) -> None:
        self.store = store
        # A running query keeps its session this long (the request deadline) past its start,
        # renewed every load poll, so that no router expires a session in use.
        self.hold_s = hold_s
        self.retry_after_s = retry_after_s
        self.in_use: Counter[str] = Counter()
        # One per session while someone holds or waits for it: two failing-over queries of
        # this router do not rebuild one session twice (the store's compare-and-set keeps
        # other routers out).
        self._locks: WeakValueDictionary[str, asyncio.Lock] = WeakValueDictionary()

    async def _call(self, call: Awaitable[T]) -> T:
        return await reachable(call, "document sessions are", self.retry_after_s)

    def lock(self, document_id: str) -> asyncio.Lock:
        lock = self._locks.get(document_id)
        if lock is None:
            lock = self._locks[document_id] = asyncio.Lock()
        return lock

    async def add(self, session: StoredSession, text: str) -> StoredSession:
        return await self._call(self.store.create(session, text))

    async def get(self, document_id: str) -> StoredSession | None:
        """The live session, or None if unknown, expired or deleted."""
        return await self._call(self.store.get(document_id))

    async def text(self, document_id: str) -> str | None:
        return await self._call(self.store.text(document_id))

    async def rebind(
        self, document_id: str, expected: str | None, new: str, *, promote: bool = False
    ) -> bool:
        """Compare-and-set of the session's replica (with `promote`, of the copy on
        `new`): False if another router moved it first, closed that copy, or it ended."""
        return await self._call(self.store.rebind(document_id, expected, new, promote=promote))

    async def add_copy(
        self, document_id: str, replica: str, max_holders: int, tenant_slots: int | None = None
    ) -> bool:
        """Record a copy of the session on `replica` (`serving/routing/copies.py`); False if
        the session ended, holds one there, has `max_holders` holders already or its tenant
        `tenant_slots` session slots (its sessions and their copies)."""
        add = self.store.add_copy(document_id, replica, max_holders, tenant_slots)
        return await self._call(add)

    async def drop_copy(self, document_id: str, replica: str, idle_s: float | None = None) -> bool:
        """Forget the copy on `replica`; with `idle_s`, only if no router's query holds it or
        used it within `idle_s` (`SessionStore.drop_copy`)."""
        return await self._call(self.store.drop_copy(document_id, replica, idle_s))

    async def lease_copy(self, document_id: str, replica: str, lease: str) -> bool:
        """Hold the copy on `replica` for one query (for as long as a query may run); False
        if it is no longer recorded."""
        hold = self.store.lease_copy(document_id, replica, lease, self.hold_s)
        return await self._call(hold)

    async def release_copy(self, document_id: str, replica: str, lease: str) -> None:
        """The query ended; if the store cannot be told, the lease runs out instead."""
        with contextlib.suppress(ServiceError):
            await self._call(self.store.release_copy(document_id, replica, lease))

    async def remove(self, document_id: str) -> StoredSession | None:
        """End the session for every router; what it was (its replica to close), or None."""
        return await self._call(self.store.delete(document_id))

    async def holdings(self) -> list[Holding]:
        """Every live session's holders (their replicas are told who holds them)."""
        return await self._call(self.store.holdings())

    async def expired(self) -> list[StoredSession]:
        """Sessions that expired, each handed to one router (which closes its KV)."""
        return await self._call(self.store.sweep())

    async def hold(self, document_id: str) -> None:
        """A query starts: the session stays alive while it runs."""
        self.in_use[document_id] += 1
        try:
            await self._call(self.store.touch(document_id, self.hold_s))
        except ServiceError:
            self._drop(document_id)
            raise

    async def release(self, document_id: str) -> None:
        """A query ended: the session's TTL counts from now (unless another still runs)."""
        self._drop(document_id)
        with contextlib.suppress(StoreUnavailable):  # the answer is out; a renewal may fail
            await self.store.touch(document_id, self.hold_s if self.in_use[document_id] else 0)

    def _drop(self, document_id: str) -> None:
        self.in_use[document_id] -= 1
        if self.in_use[document_id] <= 0:
            del self.in_use[document_id]

    async def renew_held(self) -> None:
        """Renew every session this router is querying (each load poll)."""
        for document_id in list(self.in_use):
            await self._call(self.store.touch(document_id, self.hold_s))
