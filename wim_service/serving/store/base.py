"""The session store's interface: what every backend keeps per document session and promises.

Promises of every backend (tests/serving/store/test_session_store.py checks them on each):

* `create` is atomic and fails if the id exists or was deleted within the tombstone time.
* `get`, `text`, `touch` and `rebind` see nothing of an unknown, expired or deleted session.
* `touch` renews the expiry: `ttl_s` from now, or longer while a query holds the session.
* `rebind` is a compare-and-set: of two routers that both saw the same binding, one wins, so
  a session is never bound to two replicas. A copy rebound as the primary (promoted) is no
  longer a copy.
* `add_copy` records a copy of a live session on a replica that holds none of it, within a
  limit of holders (primary and copies), in one step: two routers never both pass the limit.
  `drop_copy` forgets one. Copies are part of the session: `delete` and `sweep` return them
  (to be closed) with it. `add_copy` may also be bounded by the session slots its tenant
  holds (its sessions and their copies): a copy is on its document's tenant's books.
* A query on a copy holds a lease on it (`lease_copy`, given back by `release_copy`, or run
  out if its router died): `drop_copy(..., idle_s=...)`, what retiring and reclaiming a copy
  use, refuses a copy that any router's query holds or used within `idle_s`, so that idleness
  is judged across routers and no router closes a copy another one is reading.
* `delete` ends the session at once for every router and leaves a tombstone, so that no
  racing `create` or `rebind` brings it back.
* `sweep` hands each expired session to exactly one caller (to close its KV), then forgets it.
* The document text is removed with the session.
* A backend that cannot be reached raises `StoreUnavailable`.

It also keeps each tenant's counts, so that a tenant's limits hold across every router that
shares the store (`serving/routing/quotas.py`):

* `admit_request` counts a request in a sliding window, or refuses it, in one step.
* `start_job` counts a running job as a lease that `renew_jobs` extends while it runs; a job
  whose router died stops counting when its lease runs out.
* `reserve` counts and reserves a new session against the tenant's limit in one step; `create`
  turns the reservation into the session, `unreserve` gives it back, and an abandoned one
  expires. Two concurrent reservations never both pass the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from wim_service.wim.options import WiMOptions


class StoreUnavailable(RuntimeError):
    """The store cannot be reached now (Redis down or too slow): retry later (HTTP 503)."""


class SessionExists(RuntimeError):
    """`create` of an id that is in use or was deleted recently."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} exists or was deleted recently")
        self.session_id = session_id


def holders_of(replica: str | None, copies: tuple[str, ...]) -> tuple[str, ...]:
    """Every replica holding a document: the primary first, then the copies."""
    return (replica, *copies) if replica else copies


@dataclass(frozen=True)
class Holding:
    """Which replicas hold a live session: what the routers claim and retire copies by (a
    listing every poll, so without the options and text they do not need)."""

    session_id: str
    replica: str | None
    copies: tuple[str, ...] = ()
    tenant: str = ""  # whose books the session and its copies are on

    @property
    def holders(self) -> tuple[str, ...]:
        return holders_of(self.replica, self.copies)


@dataclass(frozen=True)
class StoredSession:
    """A document session as stored, without its text (`SessionStore.text`)."""

    session_id: str
    options: WiMOptions
    ttl_s: float
    tenant: str = ""
    # The engine replica holding the session's KV; None while it is bound nowhere.
    replica: str | None = None
    # Replicas holding copies of the document besides `replica` (a hot document's queries
    # are shared between them; `serving/routing/copies.py`).
    copies: tuple[str, ...] = ()
    context_tokens: int = 0
    segments: int = 0
    kv_blocks: int = 0  # what the session reserves on each replica holding it
    # Unix seconds; set by the store on `create` and `touch` (its own clock).
    expires_at: float = 0.0

    @property
    def holders(self) -> tuple[str, ...]:
        return holders_of(self.replica, self.copies)


class SessionStore(Protocol):
    async def create(self, session: StoredSession, text: str) -> StoredSession:
        """Store a new session and its text; it expires `ttl_s` from now, and its reservation
        (`reserve`), if any, ends. Returns it with `expires_at` set; raises `SessionExists` if
        the id is taken or was deleted recently."""
        ...

    async def get(self, session_id: str) -> StoredSession | None:
        """The live session, or None if unknown, expired or deleted."""
        ...

    async def text(self, session_id: str) -> str | None:
        """The live session's document text (decrypted), or None."""
        ...

    async def touch(self, session_id: str, hold_s: float = 0.0) -> float | None:
        """Renew the session's expiry to `max(ttl_s, hold_s)` from now (a running query holds
        it for as long as it may run); its new `expires_at`, or None if it is not live."""
        ...

    async def holdings(self) -> list[Holding]:
        """Every live session's holders (for claims; there are only as many sessions as the
        replicas' KV can pin)."""
        ...

    async def rebind(
        self, session_id: str, expected: str | None, new: str | None, *, promote: bool = False
    ) -> bool:
        """Bind the live session to `new` if it is bound to `expected` now and, with `promote`
        (promoting a copy), `new` still holds one of its copies; False otherwise (another
        router moved it first or closed that copy, or it ended)."""
        ...

    async def add_copy(
        self, session_id: str, replica: str, max_holders: int, tenant_slots: int | None = None
    ) -> bool:
        """Record a copy of the live session on `replica` unless it holds one already, the
        session has `max_holders` holders (primary included) or, with `tenant_slots`, its
        tenant holds that many session slots (its live sessions and their copies); True if
        recorded."""
        ...

    async def drop_copy(self, session_id: str, replica: str, idle_s: float | None = None) -> bool:
        """Forget the live session's copy on `replica`; False if it had none there or, with
        `idle_s`, if a query's lease holds it or one was taken or given back within `idle_s`
        (0: only a held copy is kept)."""
        ...

    async def lease_copy(self, session_id: str, replica: str, lease: str, lease_s: float) -> bool:
        """A query (`lease`, unique) runs on the live session's copy on `replica`: hold it
        for `lease_s` at most. False if that copy is not recorded (closed meanwhile)."""
        ...

    async def release_copy(self, session_id: str, replica: str, lease: str) -> None:
        """The query ended: its lease no longer holds the copy, which was used now."""
        ...

    async def delete(self, session_id: str) -> StoredSession | None:
        """End the session and leave a tombstone. Returns it as it was (one that expired but
        was not swept yet included), or None if there was nothing to delete."""
        ...

    async def sweep(self) -> list[StoredSession]:
        """Remove expired sessions and return them, each to exactly one caller."""
        ...

    async def admit_request(self, tenant: str, limit: int, window_s: float) -> float | None:
        """Count one request of the tenant unless `limit` were made in the last `window_s`;
        None if counted, else the seconds until the oldest of them leaves the window."""
        ...

    async def start_job(self, tenant: str, job_id: str, limit: int, lease_s: float) -> int | None:
        """Count the job, leased for `lease_s`, unless the tenant runs `limit` (leases not
        expired); None if counted, else how many run."""
        ...

    async def renew_jobs(self, jobs: list[tuple[str, str]], lease_s: float) -> None:
        """Extend the leases of these (tenant, job id) to `lease_s` from now; a lease that has
        already expired stays gone."""
        ...

    async def end_job(self, tenant: str, job_id: str) -> None:
        """The job ended: it no longer counts."""
        ...

    async def reserve(
        self, session: StoredSession, limit: int, lease_s: float
    ) -> dict[str, int] | None:
        """Reserve a new session for its tenant for `lease_s` unless the tenant holds `limit`
        (sessions and reservations); None if refused, else the session slots every tenant
        holds, this reservation included: a copy of a session (`add_copy`) holds a slot of
        its own, so that the fair share counts what the tenant's documents take."""
        ...

    async def unreserve(self, session: StoredSession) -> None:
        """Give back a reservation that will not become a session."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
