"""A reclaim makes room on live replicas only: a copy on a replica that was lost holds no room
any more (its session drops it at its next query), so closing it is not counted, and a refusal
is not put off for it (`ReplicaFleet.place` asks the loads again and retries after a reclaim
that closed any)."""

from __future__ import annotations

from tests.fakes.fake_service import ScriptedReplica
from tests.serving.routing.test_router_copies import opened, router_over


async def test_a_reclaim_counts_only_the_copies_it_closes_on_live_replicas() -> None:
    replicas = {name: ScriptedReplica(name) for name in ("a", "b", "c")}
    router = await router_over(*replicas.values())
    document_id = await opened(router)
    session = await router.documents.get(document_id)
    assert session is not None and session.replica is not None
    lost, spare = sorted(set(replicas) - {session.replica})
    copies = router.dispatcher.copies
    assert await copies._open(session, lost) and await copies._open(session, spare)
    replicas[lost].dead = True
    await router.fleet.refresh_loads()  # Serve routes to it no more
    assert await copies.reclaim() == 1
    assert document_id not in replicas[spare].documents
    assert document_id in replicas[session.replica].documents
    stored = await router.documents.get(document_id)  # the lost copy dropped from the store too
    assert stored is not None and stored.copies == ()
    router.shutdown()
