"""Tenant limits counted in the session store, so that they hold across every router sharing it.

* Requests per minute: a sliding minute of the tenant's requests (`admit`).
* Concurrent jobs: a lease per running job (`job`), renewed while it runs; a router that dies
  stops renewing, so its jobs stop counting one lease later and never leave the count stuck.
* Open documents: a new session is reserved against the limit in one step of the store
  (`opening`), before it is read, so that two concurrent creates cannot both pass it.

A store that cannot be reached refuses new work (503 `unavailable`); a job that already runs
keeps running, and its lease runs out if the store stays away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from wim_service.serving.auth import Tenant
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import HTTPFailure, ServiceCode
from wim_service.serving.store import SessionStore, StoredSession, StoreUnavailable, reachable

logger = logging.getLogger(__name__)
T = TypeVar("T")

RATE_WINDOW_S = 60.0


class TenantGate:
    """Each tenant's requests per minute, jobs at once and open documents, in the store."""

    def __init__(self, store: SessionStore, config: RouterConfig) -> None:
        self.store = store
        self.config = config
        self._jobs: set[tuple[str, str]] = set()  # (tenant, job id) of this router's jobs
        self._renewing: asyncio.Task[None] | None = None

    async def _call(self, call: Awaitable[T]) -> T:
        return await reachable(call, "tenant limits are", self.config.retry_after_s)

    def _refuse(self, message: str, retry_after_s: float) -> HTTPFailure:
        return HTTPFailure(ServiceCode.RATE_LIMITED, message, retry_after_s)

    async def admit(self, tenant: Tenant) -> None:
        """Count one request against the tenant's rate; 429 past it."""
        limit = tenant.limits.requests_per_minute
        wait_s = await self._call(self.store.admit_request(tenant.name, limit, RATE_WINDOW_S))
        if wait_s is not None:
            # Come back when the oldest request leaves the minute, but not in a busy loop.
            raise self._refuse(f"more than {limit} requests in a minute", max(1.0, wait_s))

    @contextlib.asynccontextmanager
    async def job(self, tenant: Tenant) -> AsyncIterator[None]:
        """Hold one of the tenant's concurrent jobs while the block runs."""
        limit, job = tenant.limits.concurrent_jobs, (tenant.name, secrets.token_hex(8))
        running = await self._call(self.store.start_job(*job, limit, self.config.job_lease_s))
        if running is not None:
            raise self._refuse(
                f"{running} jobs of this tenant are running; the limit is {limit}",
                self.config.retry_after_s,
            )
        self._jobs.add(job)
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.get_running_loop().create_task(self._renew_leases())
        try:
            yield
        finally:
            self._jobs.discard(job)
            # The answer is out: if the store cannot be told, the lease runs out instead.
            with contextlib.suppress(StoreUnavailable):
                await self.store.end_job(*job)

    async def _renew_leases(self) -> None:
        """Renew this router's job leases while it runs any (a job may outlive many)."""
        while self._jobs:
            await asyncio.sleep(self.config.job_lease_s / 3)
            try:
                await self.store.renew_jobs(sorted(self._jobs), self.config.job_lease_s)
            except StoreUnavailable as exc:
                logger.warning("could not renew the leases of %d jobs: %s", len(self._jobs), exc)

    @contextlib.asynccontextmanager
    async def opening(self, session: StoredSession, tenant: Tenant) -> AsyncIterator[None]:
        """Reserve the new session for its tenant while the block reads and creates it (the
        store's `create` takes the reservation over); 429 past the tenant's open documents."""
        limit = tenant.limits.open_documents
        # A read ends within the request deadline; a reservation left by a router that died
        # runs out then.
        lease_s = self.config.request_timeout_s
        if await self._call(self.store.reserve(session, limit, lease_s)) is None:
            raise self._refuse(
                f"{limit} document sessions are open; delete one first",
                self.config.retry_after_s,
            )
        try:
            yield
        except BaseException:
            with contextlib.suppress(StoreUnavailable):  # else it runs out with its lease
                await self.store.unreserve(session)
            raise
