"""A Ray Serve request router that sends a call to one named replica.

The WiM router keeps its own binding table (session -> replica) and passes the chosen replica
in the call's `session_id` as `replica:<unique id>`. This request router delivers the call to
exactly that replica, or fails it at once with `ReplicaGone` if the replica has left (died or
scaled down), so the caller can fail over instead of waiting. Calls without a target go to any
replica.

Every instance also publishes the live replica ids of its deployment (`live_replicas`), which
the ingress running in the same process reads to know whom to poll for load.

Ray Serve pickles the router class *by value* into the process that uses it, so the class must
not close over this module's globals (they would be copies): it imports the module at call
time to reach the one shared directory.
"""

from __future__ import annotations

import random
import threading
import time

from ray.serve._private.common import ReplicaID
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

TARGET_PREFIX = "replica:"

_lock = threading.Lock()
# deployment name -> live replica unique ids, as last broadcast by the Serve controller
_live: dict[str, frozenset[str]] = {}


class ReplicaGone(RuntimeError):
    """The replica a call was pinned to is no longer serving."""


class ReplicaUnreachable(ReplicaGone):
    """Serve could not reach the replica a call was pinned to (it may still be alive)."""


def target_key(replica: str) -> str:
    return TARGET_PREFIX + replica


def live_replicas(deployment: str) -> frozenset[str]:
    with _lock:
        return _live.get(deployment, frozenset())


def publish_replicas(deployment: str, replicas: frozenset[str]) -> None:
    with _lock:
        _live[deployment] = replicas


class PinnedReplicaRouter(ConsistentHashRouter):
    """Serve's consistent-hash router with the hash replaced by an explicit target.

    Its routing loop is the one built for affinity: the task that picked up a request keeps
    routing *that* request until it is placed (the base loop may hand a chosen replica to
    another queued request, which would send a pinned call elsewhere or orphan it).
    """

    # Serve probes a replica's queue length before sending it a call and skips replicas that
    # miss the deadline (0.1 s by default). An engine replica's event loop shares the GIL with
    # a CPU-bound engine front end, so on a busy CPU node it misses short deadlines again and
    # again; for calls that may go anywhere, allow it more time.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 30.0

    async def _select_from_candidate_replicas(
        self, candidates: list[RunningReplica], backoff_index: int
    ) -> RunningReplica | None:
        # A pinned call has one candidate and nothing to choose: skip the queue-length probe
        # (a missed probe would hold the call back) and send it; the replica itself still
        # enforces max_ongoing_requests. (Private Serve hook; Ray is pinned to 2.60.)
        if len(candidates) == 1:
            return self._replicas.get(candidates[0].replica_id)
        return await super()._select_from_candidate_replicas(candidates, backoff_index)

    # A replica Serve could not reach is failed fast for pinned calls routed this soon after.
    unreachable_memory_s = 5.0

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._unreachable()[replica_id.unique_id] = time.monotonic()

    def _unreachable(self) -> dict[str, float]:
        """Replica -> when a call last could not reach it."""
        unreachable: dict[str, float] = self.__dict__.setdefault("_unreachable_at", {})
        return unreachable

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        from wim_service.serving.replica import pinning  # the real module, not a pickled copy

        pinning.publish_replicas(
            self._deployment_id.name, frozenset(r.replica_id.unique_id for r in replicas)
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [list(candidate_replicas)]
        # Back off between retries: without it Serve's routing loop retries a busy replica in
        # a tight loop that starves the very event loop the replica's answer needs.
        pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.session_id
        if not key or not key.startswith(TARGET_PREFIX):
            shuffled = list(candidate_replicas)
            random.shuffle(shuffled)
            return [shuffled]
        wanted = key[len(TARGET_PREFIX) :]
        target = next((r for r in candidate_replicas if r.replica_id.unique_id == wanted), None)
        unreachable_at = self._unreachable().pop(wanted, None)
        recent = unreachable_at is not None and (
            time.monotonic() - unreachable_at < self.unreachable_memory_s
        )
        if target is not None and not recent:
            return [[target]]
        # The target left, or Serve could not reach it just now: fail this call now rather
        # than retrying until the caller times out. An unreachable replica would be tried
        # again and again ("temporarily unavailable") until the GCS says the actor died,
        # which it cannot while it is down; the caller decides instead (it retries once, then
        # fails over: routing/dispatcher.py). Returning the candidates (not []) lets Serve's
        # routing loop see the finished future and drop the request; with [] that loop would
        # spin without ever yielding.
        from wim_service.serving.replica import pinning

        error = (
            pinning.ReplicaGone(f"engine replica {wanted} is no longer serving")
            if target is None
            else pinning.ReplicaUnreachable(f"engine replica {wanted} could not be reached")
        )
        if not pending_request.future.done():
            pending_request.future.set_exception(error)
        return [list(candidate_replicas)]
