"""Partitions of the multi-node cluster (tests/harness/multinode.py) under the scenarios' load
(tests/harness/faults.py): a router node cut off the network, for good or for 30 s, and a
router cut off from Redis alone. Issue #42's goal, no request longer than a normal one plus
15 s during a router partition, is reported, not asserted: a timing on a shared machine
(docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness.faults import Later, Outcome, cluster_block_size, report, under_fault
from tests.harness.live_stack import from_pinned_kv
from tests.harness.multinode import Cluster, Node

pytestmark = [pytest.mark.serving, pytest.mark.multinode, pytest.mark.timeout(900)]

# A partition that heals while the questions may still wait on it.
LINK_BACK_AFTER_S = 30.0


def router_node(cluster: Cluster) -> Node:
    """The node of the first router Serve lists."""
    (_, name), _ = cluster.replicas()["WiMRouter"]
    return cluster.nodes[name]


def partition(cluster: Cluster, document: dict, node: Node, back_after_s: float | None) -> Outcome:
    """The load through `node` cut off the network, its link back after `back_after_s` (None:
    once the questions have ended). The node is then replaced as a cloud replaces a machine
    that was gone: back on the network its raylet learns the GCS declared it dead and exits."""
    comes_back = Later(back_after_s or 0.0, lambda: cluster.restore(node))

    def cut() -> None:
        cluster.cut(node)
        if back_after_s is not None:
            comes_back.start()

    def heal() -> None:
        if back_after_s is None:
            cluster.restore(node)
        else:
            comes_back.wait()
        cluster.kill_node(node)
        cluster.start_node(node)

    return under_fault(cluster, document["document_id"], fault=cut, heal=heal)


def engine_replicas(cluster: Cluster) -> set[str]:
    return {replica for replica, _ in cluster.replicas()["EngineReplica"]}


def answered_from(engines: set[str], outcome: Outcome, document: dict) -> None:
    """Nothing lost, and every answer came from a KV copy of the session (its primary, or a
    copy the policy read for the load) on the engine replicas that ran before the fault."""
    assert not outcome.lost, outcome.lost
    for answer in outcome.answers:
        assert answer.body["replica"] in engines and from_pinned_kv(
            answer.body, document, cluster_block_size()
        )


@pytest.mark.replica_step(6)
@pytest.mark.parametrize(
    "back_after_s", [None, LINK_BACK_AFTER_S], ids=["until_the_questions_end", "back_after_30_s"]
)
def test_router_node_partition(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
    back_after_s: float | None,
) -> None:
    engines = engine_replicas(cluster)
    outcome = partition(cluster, document, router_node(cluster), back_after_s)
    scenario = (
        "router node partitioned until the questions end"
        if back_after_s is None
        else f"router node partitioned, link back after {back_after_s:.0f} s"
    )
    report(record_property, scenario, outcome, normal_s)
    answered_from(engines, outcome, document)


@pytest.mark.replica_step(7)
def test_router_cut_off_from_redis_alone(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    """The router node reaches the other nodes but not Redis (its sessions and the documents'
    KV) until the questions end: the other router answers what it cannot."""
    node, engines = router_node(cluster), engine_replicas(cluster)
    outcome = under_fault(
        cluster,
        document["document_id"],
        fault=lambda: cluster.cut_from_redis(node),
        heal=lambda: cluster.reconnect_redis(node),
    )
    report(record_property, "router cut off from Redis alone", outcome, normal_s)
    answered_from(engines, outcome, document)
