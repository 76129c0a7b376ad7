"""The engine replicas as the router sees them: their loads, polled, and where work goes.

`ReplicaFleet` polls every live replica's load into the binding table, places work by the
configured policy (`RouterConfig.placement`, waiting a while when no replica is up), and marks
replicas lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from pathlib import Path

from wim_service.placement.policy import make_policy
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Work
from wim_service.serving.config import RouterConfig
from wim_service.serving.http.errors import HTTPFailure
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient
from wim_service.serving.replica.contracts import ReplicaLoad
from wim_service.serving.routing.bindings import BindingTable, BindResult, Booking
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)

# A replica that does not report within this long is skipped for this poll.
LOAD_TIMEOUT_S = 10.0


class ReplicaFleet:
    def __init__(self, client: ReplicaClient, config: RouterConfig, metrics: WiMMetrics) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        path = Path(config.cost_profile) if config.cost_profile else None
        profile = EngineProfile.load(path)
        policy = make_policy(config.placement, profile, max_copies=config.max_copies)
        self.table = BindingTable(policy, profile)

    async def refresh_loads(self) -> None:
        replicas = sorted(await self.client.live_replicas())
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
        self.metrics.kv_reserved_blocks.clear()
        for load in loads:
            self.metrics.sessions_active.labels(load.replica).set(load.sessions)
            self.metrics.resident_kv_tokens.labels(load.replica).set(load.resident_kv_tokens)
            self.metrics.kv_reserved_blocks.labels(load.replica).set(load.reserved_blocks)
        # A replica that left the routing set while calls of ours still run on it is draining:
        # Serve lets those calls finish before it stops the replica.
        self.metrics.replica_draining.clear()
        for replica, calls in self.client.in_flight.items():
            if calls and replica not in replicas:
                self.metrics.replica_draining.labels(replica).set(1)

    async def _load_of(self, replica: str) -> ReplicaLoad:
        load = await asyncio.wait_for(self.client.replica(replica).load(), LOAD_TIMEOUT_S)
        return ReplicaLoad.model_validate(load)

    def ready(self) -> list[str]:
        return [load.replica for load in self.table.loads.values() if load.healthy]

    def session_capacity(self) -> int:
        """The sessions the replicas that take new ones admit at once (their `max_sessions`):
        what the tenants' fair shares divide."""
        return sum(
            load.max_sessions
            for load in self.table.loads.values()
            if load.healthy and not load.draining
        )

    async def place(
        self,
        session: str | None,
        work: Work,
        exclude: Collection[str] = (),
        holders: Collection[str] = (),
    ) -> Booking:
        """Where `work` runs, by the policy, bound to `session` if given; waits a while for a
        first replica to come up. `holders` hold a copy of the work's document."""
        deadline = time.monotonic() + self.config.replica_wait_s
        while True:
            try:
                return self.table.place(session, work, exclude=exclude, holders=holders)
            except NoRoom as exc:
                live = exc.replicas
                if live or time.monotonic() > deadline:
                    self.metrics.binding.labels(BindResult.REJECTED).inc()
                    if live:
                        raise HTTPFailure(
                            ErrorCode.OVERLOADED,
                            f"every engine replica's KV is committed ({exc}); retry later",
                            self.config.retry_after_s,
                        ) from exc
                    raise HTTPFailure(
                        ErrorCode.UNAVAILABLE,
                        "no engine replica is ready; retry later",
                        self.config.retry_after_s,
                    ) from exc
            # No live replica (starting, or replacing a failed one): wait for one.
            await asyncio.sleep(1.0)
            await self.refresh_loads()

    def lost(self, replica: str, reason: str) -> None:
        """Count a failover off `replica` and stop placing sessions there."""
        self.metrics.failover.labels(reason).inc()
        load = self.table.loads.get(replica)
        if load is not None:
            load.healthy = False
