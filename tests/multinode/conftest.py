"""One real multi-node Ray cluster (tests/harness/multinode.py) for every module of the fault
suite: it starts at the first test of the package and each scenario leaves it whole again.
The scenarios run in their `replica_step` order (tests/conftest.py) whatever their module."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import SharedEngine
from tests.harness.faults import load, session_on
from tests.harness.multinode import Cluster
from tests.harness.redis_server import redis_binary


@pytest.fixture(scope="package")
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
        cluster.deploy()
        cluster.wait_whole("two routers and two engines on their nodes")
        yield cluster
    finally:
        cluster.teardown()


@pytest.fixture
def document(cluster: Cluster, short_report: str) -> Iterator[dict]:
    """A session of its own for each test, read just before it: no copy of it yet."""
    with session_on(cluster, short_report) as opened:
        yield opened


@pytest.fixture(scope="package")
def normal_s(cluster: Cluster, short_report: str) -> float:
    """The longest question of the scenarios' load with no fault: the normal figure, measured
    once, on a session read just before it as each scenario's is (a session copied by an
    earlier load would let a fault skip the rebuild it is there to measure)."""
    with session_on(cluster, short_report) as opened:
        answers, _, _ = load(cluster, opened["document_id"], fault=lambda: None)
    assert all(a.status == 200 and a.attempts == 1 for a in answers), answers
    return max(a.seconds for a in answers)
