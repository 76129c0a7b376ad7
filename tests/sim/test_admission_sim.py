"""`wim sim`'s admission, as the service admits: what finds no room is refused (`429` with
Retry-After), its client sends it again if its trace row says so, a call past the engine
replicas' queue bound is refused too, and goodput counts the answers within the deadline.
No engine, no network.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.sim.test_sim import doc_row, document_trace, run, write_jsonl
from wim_service.cli import main
from wim_service.placement.profile import EngineProfile
from wim_service.sim.floor import ttft_floor
from wim_service.sim.report import percentile, summarise
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request, Trace, read_trace


def retrying(row: dict[str, Any], retries: int) -> dict[str, Any]:
    return row | {"retries": retries}


def test_a_session_no_replica_has_room_for_is_refused_with_its_waiting_queries(
    tmp_path: Path,
) -> None:
    # One replica, one session slot, held by a's copy (never idle long enough to retire): b's
    # session finds no room. Its read is refused, and both of b's queries with it, as each
    # live query of a session that could not open fails; nothing waits in a queue for room.
    rows = [doc_row(0, "a", wim=True), doc_row(0.5, "b", wim=True), doc_row(0.6, "b", wim=True)]
    result = run(document_trace(rows, tmp_path), "expected_wait", 1, slots=1, copy_idle_s=300.0)
    assert (result.refused, result.retried) == (2, 0)
    assert [o.index for o in result.outcomes] == [0]
    assert summarise(result)["refused"] == 2


def test_a_refused_client_sends_again_after_the_retry_after_as_its_row_says(
    tmp_path: Path,
) -> None:
    # a's copy retires 10 s after its query ends; b is refused at 0.5 s and sends again every
    # 5 s (the Retry-After) until the first send after that finds the slot free. It then takes
    # what a took alone: its session's read and its query.
    rows = [doc_row(0, "a", wim=True), retrying(doc_row(0.5, "b", wim=True), 20)]
    result = run(document_trace(rows, tmp_path), "expected_wait", 1, slots=1, copy_idle_s=10.0)
    a, b = sorted(result.outcomes, key=lambda o: o.index)
    sends = math.ceil((a.end_s + 10.0 - 0.5) / 5.0)
    placed = 0.5 + 5.0 * sends
    assert (result.refused, result.retried) == (0, sends)
    assert b.first_token_s - placed == pytest.approx(a.first_token_s)


def test_a_client_out_of_retries_is_refused_for_good(tmp_path: Path) -> None:
    # The same, with one retry only (the replay's default for rows that say none: `retries`).
    rows = [doc_row(0, "a", wim=True), doc_row(0.5, "b", wim=True)]
    result = run(
        document_trace(rows, tmp_path), "expected_wait", 1, slots=1, copy_idle_s=10.0, retries=1
    )
    assert (result.refused, result.retried, len(result.outcomes)) == (1, 1, 1)


def test_a_call_past_the_engine_replicas_queue_bound_is_refused() -> None:
    # Three plain requests at once on one replica that takes one call, and a router queue of
    # one more: the third is refused, the second waits its turn and is answered.
    burst = tuple(
        Request(index=i, arrival_s=0.0, prompt_tokens=2000, answer_tokens=4, prefix=(i,))
        for i in range(3)
    )
    trace = Trace("mooncake", burst)
    result = run(trace, "expected_wait", 1, replica_calls=1, queued_calls=1)
    assert (result.refused, sorted(o.index for o in result.outcomes)) == (1, [0, 1])
    assert run(trace, "expected_wait", 1, replica_calls=1, queued_calls=2).refused == 0


def test_goodput_counts_the_answers_within_the_deadline_over_the_traces_arrivals() -> None:
    # Two one-token answers 0.5 s apart on one replica: the second waits for the first's
    # prefill. With a deadline between their end-to-end latencies, only the first is answered.
    # Goodput is per second of the arrivals (0.5 s), however late the last answer ends.
    burst = tuple(
        Request(index=i, arrival_s=i / 2, prompt_tokens=6000, answer_tokens=1, prefix=(i,))
        for i in range(2)
    )
    trace = Trace("mooncake", burst)
    first, second = sorted(run(trace, "expected_wait", 1).outcomes, key=lambda o: o.end_s)
    every = summarise(run(trace, "expected_wait", 1))
    assert every["requests_per_s"] == round(2 / second.end_s, 3)
    assert every["goodput_per_s"] == 4.0
    between = (first.end_s - first.arrival_s + second.end_s - second.arrival_s) / 2
    late = summarise(run(trace, "expected_wait", 1, deadline_s=between))
    assert late["goodput_per_s"] == 2.0
    # Stopped at its deadline, as the service stops it: not answered.
    assert (late["completed"], late["timed_out"]) == (1, 1)


def test_the_json_rows_carry_refusals_goodput_and_the_floor(tmp_path: Path) -> None:
    rows = [doc_row(0, "a", wim=True), doc_row(0.5, "b", wim=True), doc_row(1, "a", wim=True)]
    trace = write_jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "rows.json"
    argv = ["sim", "--trace", str(trace), "--replicas", "1", "--slots", "1"]
    assert main([*argv, "--policies", "sticky", "--json-out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["refused"], row["completed"]) == (1, 2)
    assert row["goodput_per_s"] == 2.0  # two answered in time, over 1 s of arrivals
    floors = ttft_floor(read_trace(trace), EngineProfile.load(), SimSettings(slots=1))
    assert row["floor_p95_s"] == round(percentile(list(floors.values()), 95) or 0, 3) > 0


def test_the_admission_defaults_are_the_services() -> None:
    # What the replay refuses by is what the router and the engine deployment refuse by.
    from wim_service.serving.app import EngineReplicaDeployment
    from wim_service.serving.config import RouterConfig

    settings, router = SimSettings(), RouterConfig()
    assert (settings.retry_after_s, settings.deadline_s) == (
        router.retry_after_s,
        router.request_timeout_s,
    )
    assert (settings.replica_calls, settings.queued_calls) == (
        EngineReplicaDeployment.max_ongoing_requests,
        EngineReplicaDeployment.max_queued_requests,
    )
