"""Faults of a real multi-node Ray cluster (tests/harness/multinode.py): five nodes in network
namespaces, Serve with two routers (sessions in Redis) and two vLLM engine replicas, each on
a node of its own.

The cluster starts once for the module and the scenarios run on it in order (`replica_step`,
tests/conftest.py), each leaving it whole again: the lost node is started anew, as a cloud
would replace it. Each scenario opens a document session, keeps a fixed count of questions in
flight through the fault and after it, and prints what issue #29 asks of it: requests lost,
the longest request during the fault against the same load without one (`normal_s`, once for
the module), and the time until the cluster was whole again.

A client retries a request that failed with a 5xx or a cut connection (as a client following
`Retry-After` does); a request is lost when it has no answer after `RETRIES` attempts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import SharedEngine
from tests.harness.live_stack import OPTIONS, metric_in, query_body, settled
from tests.harness.multinode import Cluster, netns_inode, processes_in
from tests.harness.redis_server import redis_binary

pytestmark = [pytest.mark.serving, pytest.mark.multinode, pytest.mark.timeout(900)]

RETRIES = 4
# Questions kept in flight through a fault, and sent after it.
IN_FLIGHT = 4
AFTER = 4


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, shared_engine: SharedEngine
) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        reason = "network namespaces need root"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the multi-node tests (it runs as root); {reason}")
        pytest.skip(f"{reason} (CI runs as root)")
    # Never more than two engines on this machine: the engine tests' one goes first.
    shared_engine.close()
    cluster = Cluster(tmp_path_factory.mktemp("mn"))
    # A SIGTERM stops the run as Ctrl-C does (tests/harness/interrupt.py): this teardown runs
    # then too.
    try:
        cluster.start(redis_binary())
        assert cluster.redis is not None
        cluster.deploy(cluster.redis.url)
        cluster.wait_for(cluster.whole, "two routers and two engines on their nodes", 600)
        yield cluster
    finally:
        cluster.teardown()


@dataclass
class Answer:
    status: int  # of the last attempt; 0: no HTTP answer
    seconds: float  # from the first attempt to the last one's end
    attempts: int
    body: dict
    router: str
    ended: float  # monotonic seconds


def ask(cluster: Cluster, document_id: str) -> Answer:
    """One question on a document session, retried on a 5xx or a cut connection."""
    started = time.monotonic()
    status, router, attempts = 0, "", 0
    body: dict = {}
    with cluster.client() as client:
        while attempts < RETRIES:
            attempts += 1
            try:
                response = client.post("/wim", json=query_body(document_id))
                status, router = response.status_code, response.headers.get("X-WiM-Router", "")
                body = response.json() if status == 200 else {"error": response.text}
            except httpx.TransportError as exc:
                status, body = 0, {"error": repr(exc)}
            if status == 200 or 0 < status < 500:
                break
            time.sleep(1.0)
    ended = time.monotonic()
    return Answer(status, ended - started, attempts, body, router, ended)


@dataclass
class Outcome:
    answers: list[Answer]
    fault_s: float  # how long striking the fault took (a node's processes all stopped)
    struck: float  # monotonic seconds when the fault had struck
    fault_to_whole_s: float

    @property
    def lost(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]

    @property
    def longest_s(self) -> float:
        return max(a.seconds for a in self.answers)

    @property
    def longest_after_fault_s(self) -> float:
        """From the fault having struck to the latest answer: the questions in flight had run
        a second before it, work the lost node took with it."""
        return max(a.ended for a in self.answers) - self.struck

    def replicas_after(self) -> set[str]:
        """The replicas that answered the questions ending once the fault had struck (one that
        ended while it was striking may still come from the replica it took)."""
        return {a.body["replica"] for a in self.answers if a.ended > self.struck}


def load(
    cluster: Cluster, document_id: str, fault: Callable[[], None]
) -> tuple[list[Answer], float, float]:
    """`IN_FLIGHT` questions running when `fault` strikes, `AFTER` more sent right after it;
    their answers, when the fault began to strike and when it had struck."""
    with ThreadPoolExecutor(IN_FLIGHT + AFTER) as pool:
        running = [pool.submit(ask, cluster, document_id) for _ in range(IN_FLIGHT)]
        # Mid-query: the engines are busy with them (one alone takes a second or more).
        time.sleep(1.0)
        striking = time.monotonic()
        fault()
        struck = time.monotonic()
        later = [pool.submit(ask, cluster, document_id) for _ in range(AFTER)]
        return [future.result() for future in running + later], striking, struck


def under_fault(
    cluster: Cluster, document_id: str, fault: Callable[[], None], heal: Callable[[], None]
) -> Outcome:
    """The questions of `load` through `fault`; then `heal` and wait until the cluster is
    whole."""
    answers, striking, struck = load(cluster, document_id, fault)
    heal()
    cluster.wait_for(cluster.whole, "the cluster whole again", 600)
    return Outcome(answers, struck - striking, struck, time.monotonic() - striking)


def report(
    record_property: Callable[[str, object], None],
    scenario: str,
    outcome: Outcome,
    normal_s: float,
    more: str = "",
) -> None:
    """The scenario's figures, printed at the end of the run (`figure` properties:
    tests/conftest.py), also under xdist and without -s (docs/reliability.md)."""
    retried = sum(a.attempts > 1 for a in outcome.answers)
    record_property(
        "figure",
        f"[multinode] {scenario}: lost {len(outcome.lost)}/{len(outcome.answers)} "
        f"(retried {retried}), longest {outcome.longest_s:.1f} s vs {normal_s:.1f} s "
        f"normal (the last answer {outcome.longest_after_fault_s:.1f} s after the fault had "
        f"struck), whole again after {outcome.fault_to_whole_s:.1f} s (the fault took "
        f"{outcome.fault_s:.1f} s to strike){more}",
    )


@contextmanager
def session_on(cluster: Cluster, text: str) -> Iterator[dict]:
    """A document session, opened (and timed: `open_s`) and ended; then no session and no KV
    reservation may be left on any replica."""
    with cluster.client() as client:
        started = time.monotonic()
        response = client.post("/documents", json={"context": text, "options": OPTIONS})
        assert response.status_code == 201, response.text
        opened = {**response.json(), "open_s": time.monotonic() - started}
        yield opened
        assert client.delete(f"/documents/{opened['document_id']}").status_code == 204
        cluster.wait_for(lambda: settled(client), "no session or reservation left", 120)


@pytest.fixture
def document(cluster: Cluster, short_report: str) -> Iterator[dict]:
    """A session of its own for each test, read just before it: no copy of it yet."""
    with session_on(cluster, short_report) as opened:
        yield opened


@pytest.fixture(scope="module")
def normal_s(cluster: Cluster, short_report: str) -> float:
    """The longest question of the scenarios' load with no fault: the normal figure, measured
    once, on a session read just before it as each scenario's is (a session copied by an
    earlier load would let a fault skip the rebuild it is there to measure)."""
    with session_on(cluster, short_report) as opened:
        answers, _, _ = load(cluster, opened["document_id"], fault=lambda: None)
    assert all(a.status == 200 and a.attempts == 1 for a in answers), answers
    return max(a.seconds for a in answers)


def from_pinned_kv(body: dict, document: dict) -> bool:
    """Answered from the session's KV (its whole blocks were cached), not a fresh read."""
    return body["usage"]["prompt_tokens_cached"] >= (document["context_tokens"] // 32) * 32


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
        assert from_pinned_kv(answer.body, document)
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
        assert answer.body["replica"] in engines and from_pinned_kv(answer.body, document)
    # Those sent after the loss went through the other router (the session is in Redis).
    assert {a.router for a in outcome.answers[IN_FLIGHT:]} == {survivor}


def per_router(client: httpx.Client, name: str, **labels: str) -> dict[str, float]:
    """A metric as each of the two routers counts it (Serve's proxy picks one per scrape)."""
    seen: dict[str, float] = {}
    for _ in range(60):
        response = client.get("/metrics")
        seen[response.headers["X-WiM-Router"]] = metric_in(response.text, name, **labels)
        if len(seen) == 2:
            return seen
    pytest.fail(f"one router answered 60 scrapes in a row: {sorted(seen)}")


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
    assert cluster.redis is not None
    cluster.deploy(cluster.redis.url, router_memory=2**20)
    cluster.wait_for(
        lambda: cluster.whole() and not routers & {r for r, _ in cluster.replicas()["WiMRouter"]},
        "new routers after the GCS restart",
        300,
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
