"""Faults of a real multi-node Ray cluster (tests/harness/multinode.py): five nodes in network
namespaces, Serve with two routers (sessions in Redis) and two vLLM engine replicas, each on
a node of its own.

The cluster starts once for the suite (tests/multinode/conftest.py) and its scenarios run on
it in order (`replica_step`, tests/conftest.py), each leaving it whole again: the lost node is
started anew, as a cloud would replace it. Each scenario opens a document session, keeps a
fixed count of questions in flight through the fault and after it, and prints what issue #29
asks of it: requests lost, the longest request during the fault against the same load without
one (`normal_s`, once for the suite), and the time until the cluster was whole again.

A client retries a request that failed with a 5xx or a cut connection (as a client following
`Retry-After` does); a request is lost when it has no answer after `RETRIES` attempts. The
cluster, the load and the figures are shared with the suite's other scenarios
(tests/multinode/conftest.py, tests/harness/faults.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.faults import (
    IN_FLIGHT,
    ask,
    cluster_block_size,
    per_router,
    report,
    under_fault,
)
from tests.harness.live_stack import from_pinned_kv, metric_in
from tests.harness.multinode import Cluster, netns_inode, processes_in

pytestmark = [pytest.mark.serving, pytest.mark.multinode, pytest.mark.timeout(900)]


@pytest.mark.replica_step(1)
def test_routers_and_engines_run_on_their_own_nodes(cluster: Cluster, document: dict) -> None:
    replicas = cluster.replicas()
    assert sorted(node for _, node in replicas["WiMRouter"]) == ["r1", "r2"]
    assert sorted(node for _, node in replicas["EngineReplica"]) == ["e1", "e2"]
    # GCS fault tolerance is on: the GCS keeps its tables in the external Redis.
    assert cluster.redis is not None
    with cluster.redis.client() as redis:
        assert any(cluster.tag.encode() in key for key in redis.keys("*"))
    # The session is answered through either router from its engine's pinned KV.
    routers = set()
    for _ in range(6):
        answer = ask(cluster, document["document_id"])
        assert answer.status == 200 and answer.attempts == 1, answer
        assert answer.body["replica"] == document["replica"]
        assert from_pinned_kv(answer.body, document, cluster_block_size())
        routers.add(answer.router)
    assert routers <= {replica for replica, _ in replicas["WiMRouter"]}


@pytest.mark.replica_step(2)
def test_router_node_loss_loses_no_request(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    replicas = cluster.replicas()
    engines = {replica for replica, _ in replicas["EngineReplica"]}
    (_, node_name), (survivor, _) = replicas["WiMRouter"]
    node = cluster.nodes[node_name]
    outcome = under_fault(
        cluster,
        document["document_id"],
        fault=lambda: cluster.kill_node(node),
        heal=lambda: cluster.start_node(node),
    )
    report(record_property, "router node loss", outcome, normal_s)
    assert not outcome.lost, outcome.lost
    # The engines were untouched: every answer came from a KV copy of the session on one of
    # them (its primary, or a copy the policy read for the load: `routing/copies.py`).
    for answer in outcome.answers:
        assert answer.body["replica"] in engines and from_pinned_kv(
            answer.body, document, cluster_block_size()
        )
    # Those sent after the loss went through the other router (the session is in Redis).
    assert {a.router for a in outcome.answers[IN_FLIGHT:]} == {survivor}


@pytest.mark.replica_step(4)
def test_engine_node_loss_loses_no_request(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    lost_replica = document["replica"]
    node = cluster.nodes[cluster.node_of("EngineReplica", lost_replica)]
    (survivor,) = {r for r, _ in cluster.replicas()["EngineReplica"]} - {lost_replica}
    with cluster.client() as client:
        reprefilled = per_router(client, "wim_reprefill_tokens_total")
        restored = metric_in(
            client.get("/metrics").text, "wim_kv_restored_tokens_total", replica=survivor
        )
    outcome = under_fault(
        cluster,
        document["document_id"],
        fault=lambda: cluster.kill_node(node),
        heal=lambda: cluster.start_node(node),
    )
    # Issue #29's goal, the longest at most the session's rebuild plus one normal job, is
    # reported, not asserted: a timing on a shared machine (docs/reliability.md).
    more = f"; the session's first read {document['open_s']:.1f} s"
    report(record_property, "engine node loss", outcome, normal_s, more)
    assert not outcome.lost, outcome.lost
    # Every answer after the loss came from the session on the surviving engine.
    survivors = outcome.replicas_after()
    assert lost_replica not in survivors and len(survivors) == 1, survivors
    # The session was rebuilt there from the KV the lost engine saved as it read the
    # document (in the cluster's Redis), not read again (docs/kv-store.md).
    tokens = document["context_tokens"]
    with cluster.client() as client:
        after = metric_in(
            client.get("/metrics").text, "wim_kv_restored_tokens_total", replica=survivor
        )
        assert after - restored >= 0.8 * tokens
        assert per_router(client, "wim_reprefill_tokens_total") == reprefilled


@pytest.mark.replica_step(3)
def test_engine_node_partition_loses_no_request(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    cut_replica = document["replica"]
    node = cluster.nodes[cluster.node_of("EngineReplica", cut_replica)]
    ended: dict[str, bool] = {}

    def heal() -> None:
        cluster.restore(node)
        # Back on the network, the node learns the GCS declared it dead and ends its raylet,
        # and with it the stale replica and its engine (their KV: the session's stale copy).
        ended["by_itself"] = cluster.engines_ended(node, 60)
        cluster.kill_node(node)  # what is left of it (a restarted machine has nothing)
        cluster.start_node(node)

    outcome = under_fault(
        cluster, document["document_id"], fault=lambda: cluster.cut(node), heal=heal
    )
    report(record_property, "engine node partition", outcome, normal_s)
    assert not outcome.lost, outcome.lost
    survivors = outcome.replicas_after()
    assert cut_replica not in survivors and len(survivors) == 1, survivors
    assert ended["by_itself"], "the partitioned node's engine outlived its return"
    # One binding: the session is on the survivor alone, and answered from its KV there.
    (survivor,) = survivors
    with cluster.client() as client:
        session = client.get(f"/documents/{document['document_id']}").json()
    assert session["replica"] == survivor, session
    answer = ask(cluster, document["document_id"])
    assert answer.status == 200 and answer.body["replica"] == survivor


@pytest.mark.replica_step(5)
def test_head_loss_keeps_answering_and_the_cluster_deploys_again(
    cluster: Cluster,
    normal_s: float,
    document: dict,
    record_property: Callable[[str, object], None],
) -> None:
    routers = {replica for replica, _ in cluster.replicas()["WiMRouter"]}
    restart: list[Callable[[], None]] = []
    # The GCS stays down while the questions run: the data plane (proxy, routers, engines,
    # Redis) needs no GCS.
    outcome = under_fault(
        cluster,
        document["document_id"],
        fault=lambda: restart.append(cluster.kill_gcs()),
        heal=lambda: restart[0](),
    )
    report(record_property, "head (GCS) loss", outcome, normal_s)
    assert not outcome.lost, outcome.lost
    assert all(a.attempts == 1 for a in outcome.answers), outcome.answers
    # Afterwards the control plane works again: a new deploy replaces the routers.
    cluster.deploy(router_memory=2**20)
    cluster.wait_whole(
        "new routers after the GCS restart",
        300,
        also=lambda: not routers & {r for r, _ in cluster.replicas()["WiMRouter"]},
    )
    answer = ask(cluster, document["document_id"])
    assert answer.status == 200 and answer.attempts == 1, answer


@pytest.mark.replica_step(99)
def test_teardown_leaves_nothing(cluster: Cluster) -> None:
    """Last: the cluster torn down (the fixture's teardown is idempotent) leaves no
    namespace, bridge, Redis or process of any node."""
    inodes = {netns_inode(node.netns) for node in cluster.nodes.values()}
    cluster.teardown()
    assert cluster.leftovers() == []
    assert processes_in(inodes) == [], "processes left in the cluster's namespaces"
    assert not Path(f"/run/netns/{cluster.head.netns}").exists()
