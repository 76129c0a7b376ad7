"""`wim sim` stops a job at its deadline as the service does (`RouterConfig.request_timeout_s`,
504 `deadline_exceeded`): the clock starts as it is sent, its engine work and its booking end,
and it counts as timed out, not answered. No engine, no network.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.test_sim import PROFILE, doc_row, document_trace, run
from wim_service.sim.replay import Replay, simulate
from wim_service.sim.report import summarise
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request, Trace

# One replica's KV holds one of these at a time: the second waits, sending again every 5 s.
HOG = Request(index=0, arrival_s=0.0, prompt_tokens=8_000, answer_tokens=6_000)
NEXT = Request(index=1, arrival_s=1.0, prompt_tokens=10_000, answer_tokens=1, retries=100)


def test_a_job_past_its_deadline_is_stopped_and_frees_its_replica_for_the_next() -> None:
    trace = Trace("mooncake", (HOG, NEXT))
    hog, late = sorted(run(trace, "expected_wait", 1).outcomes, key=lambda o: o.index)
    assert hog.end_s - hog.arrival_s > 60  # runs well past the deadline below

    result = run(trace, "expected_wait", 1, deadline_s=60.0)
    # Stopped at 60 s: no answer, and its KV and booking free at once, so the next job is
    # placed at its first send after that, not after the first job's last token.
    (answered,) = result.outcomes
    assert (answered.index, result.timed_out, result.refused) == (1, 1, 0)
    sends = int((60.0 - NEXT.arrival_s) // 5.0) + 1
    placed = NEXT.arrival_s + 5.0 * sends
    assert answered.first_token_s < late.first_token_s
    assert answered.first_token_s - placed < PROFILE.prefill.seconds(NEXT.prompt_tokens) + 1
    row = summarise(result)
    # Its clock started at the send that was placed: answered, though later than the
    # deadline after its first send, so not goodput.
    assert (row["completed"], row["timed_out"], row["goodput_per_s"]) == (1, 1, 0.0)


def test_a_query_stopped_in_its_copys_turn_hands_the_turn_to_the_next(tmp_path: Path) -> None:
    # The first query's long answer leaves no KV for the second to run beside it: the second
    # waits its turn on the copy. The first query's clock starts once its session is read (its
    # client asks then); stopped at its deadline, it hands the turn on at once.
    rows = [
        doc_row(0, "a", wim=True, tokens=8_000) | {"answer_tokens": 12_000},
        doc_row(30, "a", wim=True, tokens=8_000) | {"answer_tokens": 100},
    ]
    trace = document_trace(rows, tmp_path)
    first, waited = sorted(run(trace, "sticky", 1).outcomes, key=lambda o: o.index)
    assert waited.first_token_s > first.end_s  # in its turn, after the first query
    result = run(trace, "sticky", 1, deadline_s=60.0)
    (second,) = result.outcomes
    assert (second.index, result.timed_out) == (1, 1)
    stopped_s = PROFILE.read_seconds(8_000, saved=False) + 60.0
    assert stopped_s < second.first_token_s < stopped_s + 5.0
    assert second.end_s - second.first_token_s == pytest.approx(waited.end_s - waited.first_token_s)


def test_a_sessions_read_runs_to_its_end_whatever_the_deadline(tmp_path: Path) -> None:
    # `POST /documents` has no deadline: a read longer than it still opens the session, and
    # the query sent once it is open has a whole deadline of its own.
    # Every segment skipped (`margins`: 0): the query is short beside its document's read.
    row = doc_row(0, "a", wim=True, tokens=8_000) | {"margins": 0}
    trace = document_trace([row], tmp_path)
    (query,) = run(trace, "sticky", 1).outcomes
    read_s = PROFILE.read_seconds(8_000, saved=False)
    deadline = query.end_s - read_s + 0.1
    assert deadline < read_s
    result = run(trace, "sticky", 1, deadline_s=deadline)
    assert (len(result.outcomes), result.timed_out) == (1, 0)


def test_a_query_failed_over_keeps_its_clock(tmp_path: Path) -> None:
    # The router fails a query over within the same request: its deadline does not start
    # again on the replica that takes it over.
    trace = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (first,) = run(trace, "sticky", 2).outcomes
    sent_s = PROFILE.prefill.seconds(3000)  # once its session is read
    lost_s = first.first_token_s - 0.1
    losses = [(lost_s, first.replica)]
    (answered,) = simulate(trace, "sticky", 2, PROFILE, SimSettings(), losses).outcomes
    # Longer than the answer takes from the loss, shorter than from its send.
    deadline = (2 * answered.end_s - sent_s - lost_s) / 2
    settings = SimSettings(deadline_s=deadline)
    result = simulate(trace, "sticky", 2, PROFILE, settings, losses)
    assert (result.outcomes, result.timed_out) == ([], 1)


def test_a_query_stopped_while_its_new_copy_is_read_leaves_no_copy(tmp_path: Path) -> None:
    # The second query finds the primary busy and opens a copy on the other replica; its
    # deadline comes before that copy is read. The router's read of it is cancelled then and
    # nothing of it kept: the replica holds no copy, no KV and no queued work.
    rows = [
        doc_row(0, "a", wim=True, tokens=8_000) | {"answer_tokens": 6_000},
        doc_row(3, "a", wim=True, tokens=8_000) | {"answer_tokens": 100},
    ]
    trace = document_trace(rows, tmp_path)
    read_s = PROFILE.read_seconds(8_000, saved=True)
    assert read_s > 2.5  # the copy opened at 3 s is still being read at 3 s + the deadline
    replay = Replay(trace, "expected_wait", 2, PROFILE, SimSettings(deadline_s=2.5))
    result = replay.run(3.0 + read_s - 0.1)
    # Both stopped; opened: the session's primary on r00, then the copy on r01.
    assert (result.copies_opened, result.timed_out) == (2, 2)
    copy = replay.engines[1]
    assert (copy.copies, len(copy.queue), copy.free_blocks) == ({}, 0, copy.capacity_blocks)
    assert replay.run().outcomes == []
