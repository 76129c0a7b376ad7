"""`PinnedReplicaRouter`, Serve's request router for the router's pinned calls, over stand-ins
for Serve's replicas and pending requests (no Ray cluster)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve.request_router import PendingRequest

from wim_service.serving.replica.pinning import (
    PinnedReplicaRouter,
    ReplicaGone,
    ReplicaUnreachable,
    target_key,
)


def replica(name: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def pinned_router() -> PinnedReplicaRouter:
    """The router without Serve's set-up: only what choosing a pinned replica touches."""
    router = PinnedReplicaRouter.__new__(PinnedReplicaRouter)
    router._replica_queue_len_cache = SimpleNamespace(invalidate_key=lambda _: None)
    router._queue_len_gauge_last_update = {}
    return router


def pending(target: str) -> PendingRequest:
    metadata: Any = SimpleNamespace(session_id=target_key(target))
    return PendingRequest(args=[], kwargs={}, metadata=metadata)


async def test_a_pinned_call_goes_to_its_replica_or_fails_if_it_left() -> None:
    router, replicas = pinned_router(), [replica("a"), replica("b")]
    assert await router.choose_replicas(replicas, pending("b")) == [[replicas[1]]]
    gone = pending("c")
    await router.choose_replicas(replicas, gone)
    with pytest.raises(ReplicaGone) as failed:
        gone.future.result()
    assert not isinstance(failed.value, ReplicaUnreachable)


async def test_a_pinned_call_serve_could_not_reach_fails_instead_of_going_there_again() -> None:
    """Serve routes a call that could not reach its replica again; with the GCS down it
    would find the same replica "temporarily unavailable" until the GCS came back. The
    caller is told at once, and the next call gets a try of its own."""
    router, replicas = pinned_router(), [replica("a"), replica("b")]
    call = pending("a")
    assert await router.choose_replicas(replicas, call) == [[replicas[0]]]
    router.on_replica_actor_unavailable(replicas[0].replica_id)
    await router.choose_replicas(replicas, call)  # Serve's retry of the same call
    with pytest.raises(ReplicaUnreachable):
        call.future.result()
    assert await router.choose_replicas(replicas, pending("a")) == [[replicas[0]]]
