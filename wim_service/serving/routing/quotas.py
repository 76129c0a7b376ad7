"""Tenant limits counted in the session store, so that they hold across every router sharing it.

* Requests per minute: a sliding minute of the tenant's requests (`admit`).
* Concurrent jobs: a lease per running job (`job`), renewed while it runs; a router that dies
  stops renewing, so its jobs stop counting one lease later and never leave the count stuck.
* Open documents: a new session is reserved against the limit in one step of the store
  (`opening`), before it is read, so that two concurrent creates cannot both pass it.
* Fair share: when the fleet's session slots are nearly all taken, a tenant at its fair share
  gets no new session (`over_fair_share`), so that one tenant cannot hold them all.
* Copies of a tenant's hot documents are on its books: each holds a session slot and the
  document's KV, so a copy opens only while the tenant's sessions and copies are within its
  `open_documents` (`copy_slots`; the copies never refuse the tenant a document), and a
  reclaim asked for a tenant over its fair share closes only that tenant's own spare copies
  (`reclaim_scope`): room for it is never taken from another tenant.

A store that cannot be reached refuses new work (503 `unavailable`); a job that already runs
keeps running, and its lease runs out if the store stays away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Mapping, Set
from typing import TypeVar

from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.store import SessionStore, StoredSession, StoreUnavailable, reachable
from wim_service.serving.tenants import Tenant, TenantLimits

logger = logging.getLogger(__name__)
T = TypeVar("T")

RATE_WINDOW_S = 60.0


def over_fair_share(
    asker: str, held: Mapping[str, int], capacity: int, *, tenants: Set[str], headroom: float
) -> int | None:
    """The fair share `asker` has reached if it may not open another session now, else None.

    `held`: the sessions (open or being opened) of each tenant; `capacity`: the session slots
    of the fleet; `tenants`: the configured tenants that may open sessions. The fleet is nearly
    full when at most `headroom` of its slots (at least one) are free. Then a tenant gets a new
    session only while it holds fewer than its fair share: the capacity divided among the
    tenants holding or asking for sessions, plus one if another configured tenant holds none
    (so that a tenant who comes later finds a slot), at least 1 each. A tenant alone, with no
    other that could come, may take every slot.
    """
    if capacity <= 0:  # no replica to place it on: placement answers that (503)
        return None
    if capacity - sum(held.values()) > max(1, math.ceil(capacity * headroom)):
        return None
    holders = {t for t, n in held.items() if n > 0} | {asker}
    sharing = len(holders) + (1 if tenants - holders else 0)
    if sharing == 1:  # nobody to leave a slot for: a full fleet is placement's 429 `overloaded`
        return None
    share = max(1, capacity // sharing)
    return share if held.get(asker, 0) >= share else None


def reclaim_scope(
    asker: str | None,
    held: Mapping[str, int],
    capacity: int,
    *,
    tenants: Set[str],
    headroom: float,
) -> str | None:
    """Whose spare copies a reclaim for `asker`'s work may close: `asker`'s alone if it is
    over its fair share (`over_fair_share` of the slots `held`), else anyone's (None)."""
    if asker is None:
        return None
    over = over_fair_share(asker, held, capacity, tenants=tenants, headroom=headroom)
    return asker if over is not None else None


@dataclasses.dataclass
class JobLease:
    """One running job of a tenant, counted in the store until it is given back."""

    tenant: str
    job_id: str
    taken_over: bool = False  # by the job it was taken for, which gives it back


class TenantGate:
    """Each tenant's requests per minute, jobs at once and open documents, in the store."""

    def __init__(
        self,
        store: SessionStore,
        config: RouterConfig,
        tenants: Set[str],
        limits: Mapping[str, TenantLimits] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.tenants = tenants  # those that may open document sessions (for the fair share)
        self.limits = limits or {}  # each configured tenant's (none in open mode)
        self._jobs: set[tuple[str, str]] = set()  # (tenant, job id) of this router's jobs
        self._renewing: asyncio.Task[None] | None = None

    def copy_slots(self, tenant: str) -> int:
        """The session slots `tenant`'s sessions and their copies may hold together: its
        `open_documents` (the default limits' in open mode)."""
        return self.limits.get(tenant, TenantLimits()).open_documents

    def reclaim_scope(
        self, asker: str | None, held: Mapping[str, int], capacity: int
    ) -> str | None:
        """`reclaim_scope` with this service's tenants and headroom."""
        headroom = self.config.fair_share_headroom
        return reclaim_scope(asker, held, capacity, tenants=self.tenants, headroom=headroom)

    async def _call(self, call: Awaitable[T]) -> T:
        return await reachable(call, "tenant limits are", self.config.retry_after_s)

    def _refuse(self, message: str, retry_after_s: float) -> ServiceError:
        return ServiceError(ServiceCode.RATE_LIMITED, message, retry_after_s)

    async def admit(self, tenant: Tenant) -> None:
        """Count one request against the tenant's rate; 429 past it."""
        limit = tenant.limits.requests_per_minute
        wait_s = await self._call(self.store.admit_request(tenant.name, limit, RATE_WINDOW_S))
        if wait_s is not None:
            # Come back when the oldest request leaves the minute, but not in a busy loop.
            raise self._refuse(f"more than {limit} requests in a minute", max(1.0, wait_s))

    async def _take(self, tenant: Tenant) -> JobLease:
        """One of the tenant's concurrent jobs; 429 past its limit."""
        limit, lease = tenant.limits.concurrent_jobs, JobLease(tenant.name, secrets.token_hex(8))
        job = (lease.tenant, lease.job_id)
        running = await self._call(self.store.start_job(*job, limit, self.config.job_lease_s))
        if running is not None:
            raise self._refuse(
                f"{running} jobs of this tenant are running; the limit is {limit}",
                self.config.retry_after_s,
            )
        self._jobs.add(job)
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.get_running_loop().create_task(self._renew_leases())
        return lease

    async def _give_back(self, lease: JobLease) -> None:
        job = (lease.tenant, lease.job_id)
        self._jobs.discard(job)
        # The answer is out: if the store cannot be told, the lease runs out instead.
        with contextlib.suppress(StoreUnavailable):
            await self.store.end_job(*job)

    @contextlib.asynccontextmanager
    async def lease(self, tenant: Tenant) -> AsyncIterator[JobLease]:
        """One of the tenant's concurrent jobs, taken before the costly work that precedes a
        job (tokenizing a `/v1` prompt), so that a tenant past its limit costs no CPU. The job
        the block starts takes it over (`job(tenant, lease)`); else it is given back here."""
        lease = await self._take(tenant)
        try:
            yield lease
        finally:
            if not lease.taken_over:
                await self._give_back(lease)

    @contextlib.asynccontextmanager
    async def job(self, tenant: Tenant, lease: JobLease | None = None) -> AsyncIterator[None]:
        """Hold one of the tenant's concurrent jobs while the block runs: `lease` if given
        (taken earlier by `lease`), else a new one."""
        if lease is None:
            lease = await self._take(tenant)
        lease.taken_over = True
        try:
            yield
        finally:
            await self._give_back(lease)

    async def _renew_leases(self) -> None:
        """Renew this router's job leases while it runs any (a job may outlive many)."""
        while self._jobs:
            await asyncio.sleep(self.config.job_lease_s / 3)
            try:
                await self.store.renew_jobs(sorted(self._jobs), self.config.job_lease_s)
            except StoreUnavailable as exc:
                logger.warning("could not renew the leases of %d jobs: %s", len(self._jobs), exc)

    @contextlib.asynccontextmanager
    async def opening(
        self, session: StoredSession, tenant: Tenant, capacity: int
    ) -> AsyncIterator[None]:
        """Reserve the new session for its tenant while the block reads and creates it (the
        store's `create` takes the reservation over); 429 past the tenant's open documents or,
        with the fleet's `capacity` session slots nearly full, past its fair share."""
        limit = tenant.limits.open_documents
        # A read ends within the request deadline; a reservation left by a router that died
        # runs out then.
        lease_s = self.config.request_timeout_s
        held = await self._call(self.store.reserve(session, limit, lease_s))
        if held is None:
            raise self._refuse(
                f"{limit} document sessions are open; delete one first",
                self.config.retry_after_s,
            )
        try:
            before = {**held, tenant.name: held[tenant.name] - 1}  # without this reservation
            share = over_fair_share(
                tenant.name,
                before,
                capacity,
                tenants=self.tenants,
                headroom=self.config.fair_share_headroom,
            )
            if share is not None:
                raise self._refuse(
                    f"the service's {capacity} document sessions are nearly all in use and "
                    f"this tenant holds {before[tenant.name]} of them, at least its fair share "
                    f"of {share}; delete one or retry later",
                    self.config.retry_after_s,
                )
            yield
        except BaseException:
            with contextlib.suppress(StoreUnavailable):  # else it runs out with its lease
                await self.store.unreserve(session)
            raise
