"""Control-plane and store outages of the multi-node cluster (tests/harness/multinode.py) under
the scenarios' load (tests/harness/faults.py): an engine node lost while the head is away for
longer than Ray's default reconnect timeout, and Redis restarting while an engine node is
lost. While the head is away the GCS is down, so nobody tells the routers that the engine's
actor died until it is back; an engine node lost while the GCS alone is down is no scenario
of its own any more (docs/reliability.md, "Every scenario").

The head away: its host lost whole (GCS, raylet, dashboard, Serve's controller and the head's
proxy) and started again with the same `ray start --head` (docs/deploy.md, "What survives
what"); the GCS reads its tables back from Redis and the other hosts, which wait up to
`RAY_gcs_rpc_server_reconnect_timeout_s` for it (600 s, as documented), rejoin. Meanwhile the
clients' load balancer sends requests to the other hosts' proxies.

`HEAD_AWAY_S` is 90 s in the default run: past Ray's default reconnect timeout (60 s), which
would have ended every node of the cluster. WIM_LONG_OUTAGE=1 runs the goal's 5 minutes
instead (docs/testing.md): about 8 minutes more.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from tests.harness.faults import Answer, Later, Outcome, load, report, under_fault
from tests.harness.multinode import Cluster, Node

pytestmark = [pytest.mark.serving, pytest.mark.multinode, pytest.mark.timeout(1500)]

HEAD_AWAY_S = 300.0 if os.environ.get("WIM_LONG_OUTAGE") == "1" else 90.0
# Another round of questions this often while the head is away.
ROUND_EVERY_S = 40.0
# A restart of Redis as a supervisor makes it (stopped, its data written; started again).
REDIS_DOWN_S = 5.0


def engine_node(cluster: Cluster, document: dict) -> Node:
    """The node of the engine replica the session was read on."""
    return cluster.nodes[cluster.node_of("EngineReplica", document["replica"])]


def failed_over(outcome: Outcome, document: dict) -> None:
    """Nothing lost, and every answer once the fault had struck came from the session on the
    surviving engine (rebuilt there, or a copy read there before)."""
    assert not outcome.lost, outcome.lost
    survivors = outcome.replicas_after()
    assert document["replica"] not in survivors and len(survivors) == 1, survivors


def rebuild(document: dict) -> str:
    return f"; the session's first read {document['open_s']:.1f} s"


def through_head_outage(cluster: Cluster, document: dict, also: Node | None) -> tuple[Outcome, int]:
    """The head host lost (and `also`, if given) when the load strikes, started again
    `HEAD_AWAY_S` later; a round of the load every `ROUND_EVERY_S` until then. The outcome of
    every round, and the rounds' count."""
    head_back = Later(HEAD_AWAY_S, lambda: cluster.start_node(cluster.head))

    def fault() -> None:
        cluster.kill_node(cluster.head)
        if also is not None:
            cluster.kill_node(also)
        head_back.start()

    answers, striking, struck = load(cluster, document["document_id"], fault)
    rounds = 1
    while not head_back.done(ROUND_EVERY_S):
        more: list[Answer] = load(cluster, document["document_id"], lambda: None)[0]
        answers += more
        rounds += 1
    if also is not None:
        cluster.start_node(also)
    cluster.wait_whole("the cluster whole again")
    return Outcome(answers, struck - striking, struck, time.monotonic() - striking), rounds


@pytest.mark.replica_step(9)
def test_engine_node_loss_while_the_head_is_away(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    """The head host lost for longer than Ray's default reconnect timeout, and with it the
    engine node holding the session: the routers on the other hosts answer throughout from
    the surviving engine, and the head restarted finds that engine's replica unrestarted
    (with Ray's default 60 s its raylet would have exited)."""
    node = engine_node(cluster, document)
    engines = {replica for replica, _ in cluster.replicas()["EngineReplica"]}
    outcome, rounds = through_head_outage(cluster, document, also=node)
    scenario = f"engine node lost while the head is away {HEAD_AWAY_S:.0f} s"
    more = f"; {rounds} rounds of questions{rebuild(document)}"
    report(record_property, scenario, outcome, normal_s, more)
    failed_over(outcome, document)
    survivor = engines - {document["replica"]}
    assert survivor <= {replica for replica, _ in cluster.replicas()["EngineReplica"]}
    assert {a.body["replica"] for a in outcome.answers} <= engines


@pytest.mark.replica_step(10)
def test_redis_restart_while_an_engine_node_is_lost(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    """Redis (the sessions, the documents' KV, the GCS's tables) stopped as the engine node
    holding the session is lost, and started again `REDIS_DOWN_S` later: the session is
    rebuilt on the surviving engine from what Redis kept."""
    node = engine_node(cluster, document)
    gcs_kept: list[bool] = []

    def fault() -> None:
        cluster.kill_node(node)
        cluster.restart_redis(REDIS_DOWN_S)

    def heal() -> None:
        gcs_kept.append(cluster.gcs_running())
        if not gcs_kept[0]:
            # As a supervisor would: the head started again whole (docs/deploy.md).
            cluster.kill_node(cluster.head)
            cluster.start_node(cluster.head)
        cluster.start_node(node)

    outcome = under_fault(cluster, document["document_id"], fault, heal)
    scenario = f"Redis restarted ({REDIS_DOWN_S:.0f} s down) while an engine node is lost"
    more = f"{rebuild(document)}; the GCS {'ran on' if gcs_kept[0] else 'exited'}"
    report(record_property, scenario, outcome, normal_s, more)
    failed_over(outcome, document)
