"""Cheapest-first admission in the router (`ReplicaFleet.admit`, `placement/admission.py`)
over HTTP and fake replicas: once placements have kept finding no room for `short_s`, the
costliest arrivals are refused (429) and the cheaper answered; a session opened is admitted
with its first query; the rule lets go `short_s` after the last placement that found no room.
The router's clock for the rule is a fake one: no test waits."""

from __future__ import annotations

import asyncio
import math

from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeReplica
from tests.fakes.router import make_service, metric
from wim_service.engine.config import EngineConfig
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.routing.sizing import JobSizer
from wim_service.wim.options import WiMOptions

SHORT_S = 1.0
# A document six times DOCUMENT's length: a job on it costs several times more engine time
# (its prefill and one margin per segment) and still fits the replica; one of sixteen does not.
LONG = DOCUMENT * 6
HUGE = DOCUMENT * 16
QUERY = "What is the code?"


class Clock:
    """The rule's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def short_service(**router: object) -> tuple[TestClient, WiMRouter, Clock]:
    """A router over one busy replica (jobs running, work queued: none starts at once) that
    holds a job on LONG but not on HUGE, its rule acting after SHORT_S of being short, its
    answers' cost counted twice."""
    sizer = JobSizer(EngineConfig())
    long_blocks = sizer.blocks(asyncio.run(sizer.shape(LONG, WiMOptions(), QUERY)), one_shot=True)
    replica = FakeReplica("a", capacity=long_blocks * 3 // 2)
    # More than the jobs of a test end before a report says so (the ledger takes them off).
    replica.running, replica.backlog_s = 100, 1000.0
    client, wim_router = make_service(
        replica,
        cheapest_first_short_s=SHORT_S,
        cheapest_first_window_s=60,
        cheapest_first_short_arrivals=0,
        cheapest_first_window_arrivals=0,
        cheapest_first_slack=2,
        **router,
    )
    clock = Clock()
    assert wim_router.fleet.admission is not None
    wim_router.fleet.admission.clock = clock
    return client, wim_router, clock


def one_shot(client: TestClient, context: str) -> tuple[int, dict]:
    response = client.post("/wim", json={"context": context, "query": QUERY})
    return response.status_code, response.json()


def answered_query(client: TestClient) -> str:
    """Open a session on DOCUMENT and have one query answered: what the fleet answers, in the
    books (the cheapest work here: a few margins over a held document). Its document id."""
    opened = client.post("/documents", json={"context": DOCUMENT})
    assert opened.status_code == 201, opened.text
    document_id = opened.json()["document_id"]
    query = client.post("/wim", json={"document_id": document_id, "query": QUERY})
    assert query.status_code == 200, query.text
    return document_id


def jobs_on(replica: FakeReplica) -> int:
    """The jobs and reads sent to `replica` (not its load polls and claims)."""
    return sum(call in ("run", "query_document", "open_document") for call in replica.calls)


def ask(client: TestClient, document_id: str) -> int:
    return client.post("/wim", json={"document_id": document_id, "query": QUERY}).status_code


def make_short(client: TestClient, clock: Clock) -> None:
    """Two jobs no replica has room for, 0.6 SHORT_S apart, and 0.6 SHORT_S more: the fleet has
    been short long enough for the rule to act."""
    for _ in range(2):
        status, body = one_shot(client, HUGE)
        assert status == 429 and "KV is committed" in body["message"], body
        clock.now += 0.6 * SHORT_S


def test_once_short_the_router_refuses_the_costliest_arrivals_and_answers_cheaper_ones() -> None:
    client, router, clock = short_service()
    cheap = answered_query(client)
    make_short(client, clock)
    replica = router.fleet.client.replicas["a"]  # type: ignore[attr-defined]
    calls = jobs_on(replica)
    rejected = metric(client, "wim_session_binding_total", result="rejected")

    status, body = one_shot(client, LONG)
    assert status == 429 and body["code"] == "overloaded", body
    assert "costs more engine time than most" in body["message"]
    assert metric(client, "wim_admission_refused_total") == 1
    # Refused before placement: no call reached the replica, no placement was rejected.
    assert jobs_on(replica) == calls
    assert metric(client, "wim_session_binding_total", result="rejected") == rejected
    assert router.fleet.ledger.loads["a"].reserved_blocks == 0

    assert ask(client, cheap) == 200  # cheaper than the level: answered

    clock.now += SHORT_S  # past SHORT_S after the last placement that found no room
    assert one_shot(client, LONG)[0] == 200
    assert metric(client, "wim_admission_refused_total") == 1


def test_a_session_is_admitted_as_it_opens_and_its_first_query_is_not_asked_again() -> None:
    client, router, _ = short_service()
    opened = client.post("/documents", json={"context": LONG})
    assert opened.status_code == 201, opened.text
    document_id = opened.json()["document_id"]
    admission = router.fleet.admission
    assert admission is not None
    arrivals = admission.arrivals  # the open's among them
    assert ask(client, document_id) == 200
    assert admission.arrivals == arrivals  # not booked again
    assert router.fleet.first_query(document_id) is None  # taken by that query
    assert ask(client, document_id) == 200
    assert admission.arrivals == arrivals + 1  # the next one is an arrival as any


def test_a_session_opens_only_if_its_first_query_would_be_admitted() -> None:
    client, _, clock = short_service()
    answered_query(client)
    make_short(client, clock)
    refused = client.post("/documents", json={"context": LONG})
    assert refused.status_code == 429 and refused.json()["code"] == "overloaded", refused.text
    assert "costs more engine time than most" in refused.json()["message"]
    assert client.post("/documents", json={"context": DOCUMENT}).status_code == 201


async def test_the_water_level_is_exported_while_short_and_infinite_otherwise() -> None:
    _, router, clock = await asyncio.to_thread(short_service)
    level = "wim_admission_water_level_seconds"
    await router.fleet.refresh_loads()
    assert router.metrics.registry.get_sample_value(level) == math.inf
    admission = router.fleet.admission
    assert admission is not None
    admission.answered(1.0)
    for _ in range(3):
        admission.arrive(5.0)
    admission.fell_short()
    clock.now = 0.6 * SHORT_S
    admission.fell_short()
    clock.now = 1.2 * SHORT_S
    await router.fleet.refresh_loads()
    # Slack 2 over 1 s answered: no 5 s arrival fits; the level is the band around 5 s.
    assert router.metrics.registry.get_sample_value(level) == 5.0 * 1.02


def test_the_rule_is_off_when_turned_off_or_under_another_policy() -> None:
    for options in ({"cheapest_first": False}, {"placement": "round_robin"}):
        _, router = make_service(FakeReplica("a"), **options)
        assert router.fleet.admission is None
    _, router = make_service(FakeReplica("a"))
    assert router.fleet.admission is not None  # on by default, with expected_wait


def test_a_job_past_the_deadline_at_the_engines_measured_pace_is_refused_413() -> None:
    # Ten answers each reported taking 1,000 engine seconds: at that pace a one-shot job on
    # DOCUMENT would run past the 900 s deadline, so it is refused as it arrives, whatever
    # the fleet's load (an idle replica here), with what it would take.
    replica = FakeReplica("a")
    replica.took_s = 1000.0
    client, _ = make_service(replica)
    for _ in range(10):
        assert one_shot(client, DOCUMENT)[0] == 200
    status, body = one_shot(client, DOCUMENT)
    assert (status, body["code"]) == (413, "too_long"), body
    assert "past the request deadline of 900 s" in body["message"]
    assert metric(client, "wim_admission_refused_total", code="too_long") == 1
    assert metric(client, "wim_admission_refused_total", code="overloaded") == 0
    assert jobs_on(replica) == 10


def test_while_short_a_job_past_the_deadline_is_refused_429_to_be_retried() -> None:
    # The fleet short, then the pace measured at 1,000 engine seconds per estimated second:
    # the pace may be the engines' queues as much as their speed, so the refusal is 429.
    client, router, clock = short_service()
    make_short(client, clock)
    admission = router.fleet.admission
    assert admission is not None
    for _ in range(10):
        admission.answered(1.0, took_s=1000.0)
    status, body = one_shot(client, DOCUMENT)
    assert (status, body["code"]) == (429, "overloaded"), body
    assert "past the request deadline" in body["message"]
    assert "retry later" in body["message"]
    assert metric(client, "wim_admission_refused_total", code="overloaded") == 1


async def test_the_pace_is_exported_once_measured() -> None:
    _, router = await asyncio.to_thread(make_service, FakeReplica("a"))
    pace = "wim_admission_pace"
    await router.fleet.refresh_loads()
    assert math.isnan(router.metrics.registry.get_sample_value(pace) or 0.0)
    admission = router.fleet.admission
    assert admission is not None
    for took in range(1, 11):
        admission.answered(2.0, took_s=float(took))  # 0.5x ... 5x the cost
    await router.fleet.refresh_loads()
    assert router.metrics.registry.get_sample_value(pace) == 0.5
