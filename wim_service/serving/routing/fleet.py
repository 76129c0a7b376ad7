"""The engine replicas as the router sees them: their loads, polled, and where sessions go.

`ReplicaFleet` polls every live replica's load into the binding table, places new sessions
(bounded load, waiting a while when no replica is up), and marks replicas lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

from wim_service.serving.config import RouterConfig
from wim_service.serving.http.errors import HTTPFailure
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient
from wim_service.serving.replica.contracts import ReplicaLoad
from wim_service.serving.routing.bindings import BindingTable, BindResult, NoCapacity
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)

# A replica that does not report within this long is skipped for this poll.
LOAD_TIMEOUT_S = 10.0


class ReplicaFleet:
    def __init__(self, client: ReplicaClient, config: RouterConfig, metrics: WiMMetrics) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.table = BindingTable()

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

    async def place(self, session: str | None, needed: int, exclude: set[str]) -> str:
        """Bind a session to a replica with room (None: only choose one), waiting a while for
        one to come up."""
        deadline = time.monotonic() + self.config.replica_wait_s
        while True:
            try:
                return self.table.place(session, needed, exclude=exclude)
            except NoCapacity as exc:
                if exc.live or time.monotonic() > deadline:
                    self.metrics.binding.labels(BindResult.REJECTED).inc()
                    if exc.live:
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
