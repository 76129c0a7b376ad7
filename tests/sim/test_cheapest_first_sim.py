"""`wim sim` with cheapest-first admission (`placement/admission.py`, `SimSettings.
cheapest_first`): at saturation expected wait turns the costliest arrivals away and answers
more within the deadline; with room, or with another policy, the setting changes nothing; a
turned-away request is sent again if its row says so, and asked again; a failed-over job is
not. No engine, no network."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.profile import PROFILE
from tests.sim.test_sim import doc_row, document_trace, run
from wim_service.cli import main
from wim_service.placement.admission import AdmissionRule, CheapestFirst
from wim_service.sim.generate import GeneratorOptions, generate, write_trace
from wim_service.sim.replay import Loss, Replay
from wim_service.sim.report import summarise
from wim_service.sim.result import RunResult
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request, Trace, read_trace

# Sessions of a few hot documents (1.5k-7k tokens), 3 queries a second for 300 s: two
# replicas answer about half of it within a minute. Each replay takes about 0.1 s.
HOT = GeneratorOptions(
    requests=900,
    rate=3.0,
    documents=5,
    zipf_exponent=1.5,
    queries_per_session=8,
    think_s=2.0,
    document_tokens=(1500, 7000),
    seed=1,
)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def hot_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hot") / "hot.jsonl"
    write_trace(generate(HOT), path)
    return path


@pytest.fixture(scope="module")
def hot(hot_path: Path) -> Trace:
    return read_trace(hot_path)


def rule(trace: Trace, policy: str, replicas: int, on: bool, **settings: Any) -> RunResult:
    return run(trace, policy, replicas, cheapest_first=on, deadline_s=DEADLINE_S, **settings)


def test_expected_wait_at_saturation_turns_the_costliest_away_and_answers_more(
    hot: Trace,
) -> None:
    with_rule, without = (rule(hot, "expected_wait", 2, on) for on in (True, False))
    assert with_rule.turned_away > 0 and without.turned_away == 0
    # Each turned away is refused (no retries here), on top of what found no room.
    assert with_rule.refused >= with_rule.turned_away
    good, good_without = (summarise(r)["goodput_per_s"] for r in (with_rule, without))
    assert good >= good_without
    assert len(with_rule.outcomes) >= len(without.outcomes)


@pytest.mark.parametrize("policy", ["round_robin", "sticky"])
def test_other_policies_ignore_the_setting(hot: Trace, policy: str) -> None:
    with_rule = rule(hot, policy, 2, True)
    assert with_rule.turned_away == 0 and with_rule.refused > 0  # saturated all the same
    assert with_rule == rule(hot, policy, 2, False)
    assert Replay(hot, policy, 2, PROFILE, SimSettings()).admission is None


def test_with_room_to_spare_the_rule_turns_nothing_away_and_changes_nothing(hot: Trace) -> None:
    # Sixteen replicas of eight slots: no placement finds no room, so the rule never acts.
    with_rule = rule(hot, "expected_wait", 16, True, slots=8)
    assert (with_rule.turned_away, with_rule.refused) == (0, 0)
    assert with_rule == rule(hot, "expected_wait", 16, False, slots=8)


def test_wim_sim_no_cheapest_first_reaches_the_replay(hot_path: Path, tmp_path: Path) -> None:
    rows = {}
    for flag in ("--cheapest-first", "--no-cheapest-first"):
        out = tmp_path / f"{flag}.json"
        argv = ["sim", "--trace", str(hot_path), "--replicas", "2", "--policies"]
        argv += ["expected_wait", "--deadline-s", str(DEADLINE_S), "--json-out", str(out)]
        assert main([*argv, flag]) == 0
        (rows[flag],) = json.loads(out.read_text())
    assert rows["--cheapest-first"]["turned_away"] > 0
    assert rows["--no-cheapest-first"]["turned_away"] == 0


# -- what the replay asks the rule, with a scripted rule ---------------------------------------


class Scripted(CheapestFirst):
    """Admission that refuses the asks numbered in `refuse` (from 0, in order) and records
    every ask, answer and no-room."""

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        super().__init__(AdmissionRule(), clock=lambda: 0.0)
        self.refuse = refuse
        self.asked: list[float] = []
        self.answers: list[float] = []
        self.short = 0

    def arrive(self, cost: float, *, idle: bool = False) -> bool:
        self.asked.append(cost)
        return len(self.asked) - 1 not in self.refuse

    def answered(self, cost: float, took_s: float | None = None) -> None:
        self.answers.append(cost)

    def fell_short(self) -> None:
        self.short += 1


def scripted(
    trace: Trace, replicas: int, script: Scripted, losses: Sequence[Loss] = (), **settings: Any
) -> RunResult:
    replay = Replay(trace, "expected_wait", replicas, PROFILE, SimSettings(**settings), losses)
    assert isinstance(replay.admission, CheapestFirst)  # expected wait's, on by default
    replay.admission = script
    return replay.run()


def test_a_turned_away_query_is_sent_again_asked_again_and_answered(tmp_path: Path) -> None:
    trace = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (alone,) = scripted(trace, 1, Scripted()).outcomes
    script = Scripted(refuse=frozenset([0]))
    result = scripted(trace, 1, script, retries=1)
    assert (result.turned_away, result.retried, result.refused) == (1, 1, 0)
    # The same query asked twice at the same cost, answered once, its session opened at the
    # retry: everything as alone, 5 s (the Retry-After) later.
    assert script.asked == [alone_cost(trace)] * 2 and script.answers == script.asked[:1]
    (answered,) = result.outcomes
    assert answered.first_token_s == pytest.approx(alone.first_token_s + 5.0)


def alone_cost(trace: Trace) -> float:
    script = Scripted()
    scripted(trace, 1, script)
    (cost,) = script.asked
    return cost


def test_a_retry_whose_document_was_retired_meanwhile_opens_its_session_again(
    tmp_path: Path,
) -> None:
    # a's first query is answered; its second arrives while a is still held and is turned
    # away; a's copy retires (idle 1 s) before the retry 5 s later, which opens a's session
    # again (a second read) instead of asking for a holder that no longer exists.
    first = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (alone,) = scripted(first, 1, Scripted(), copy_idle_s=1.0).outcomes
    again_s = round(alone.end_s + 0.5, 3)
    trace = document_trace([doc_row(0, "a", wim=True), doc_row(again_s, "a", wim=True)], tmp_path)
    script = Scripted(refuse=frozenset([1]))
    result = scripted(trace, 1, script, copy_idle_s=1.0, retries=1)
    assert (result.turned_away, result.retried, result.refused) == (1, 1, 0)
    assert result.copies_opened == 2 and result.copies_retired == 2
    assert sorted(o.index for o in result.outcomes) == [0, 1]
    assert len(script.asked) == 3 and len(script.answers) == 2


def test_a_request_refused_for_no_room_is_asked_again_at_its_retry() -> None:
    # Three plain requests at once on one replica that takes one call and queues one: the
    # third finds no room, is refused and sent again; the rule is asked again then.
    burst = tuple(
        Request(index=i, arrival_s=0.0, prompt_tokens=2000, answer_tokens=4, prefix=(i,))
        for i in range(3)
    )
    script = Scripted()
    result = scripted(
        Trace("mooncake", burst), 1, script, replica_calls=1, queued_calls=1, retries=1
    )
    assert (result.turned_away, result.retried, result.refused, script.short) == (0, 1, 0, 1)
    assert len(script.asked) == 4 and len(result.outcomes) == 3
    assert sorted(script.answers) == sorted(script.asked[:3])


def test_a_failed_over_query_is_not_asked_again(tmp_path: Path) -> None:
    trace = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (first,) = scripted(trace, 2, Scripted()).outcomes
    script = Scripted()
    losses = [(first.first_token_s - 0.1, first.replica)]
    result = scripted(trace, 2, script, losses)
    (answered,) = result.outcomes
    assert answered.replica != first.replica
    assert len(script.asked) == 1 and script.answers == script.asked
    assert (result.turned_away, result.retried, result.refused) == (0, 0, 0)


def test_a_job_stopped_at_the_deadline_tells_the_rule_the_fleet_fell_short() -> None:
    # A short plain request, then alone a long one, the deadline between their durations:
    # the long one is stopped and timed out, and the rule hears the fleet fell short (with
    # KV to spare nothing finds no room: overload shows as time-outs only).
    trace = Trace(
        "mooncake",
        tuple(
            Request(index=i, arrival_s=at, prompt_tokens=tokens, answer_tokens=4, prefix=(i,))
            for i, (at, tokens) in enumerate(((0.0, 1000), (100.0, 8000)))
        ),
    )
    alone = Scripted()
    short, long = scripted(trace, 1, alone).outcomes
    took = (short.end_s - short.arrival_s, long.end_s - long.arrival_s)
    assert took[0] < took[1] and alone.short == 0
    script = Scripted()
    result = scripted(trace, 1, script, deadline_s=sum(took) / 2)
    assert (result.timed_out, result.refused, len(result.outcomes)) == (1, 0, 1)
    assert script.short == 1


def test_a_request_too_long_for_the_deadline_at_the_measured_pace_is_refused_at_once() -> None:
    # Twelve short plain requests answered one by one measure the pace; then a long one that
    # alone takes longer than the deadline: without the rule it runs until stopped, with it
    # it is refused as it arrives (turned away), and nothing times out.
    rows = [(5.0 * i, 1000) for i in range(12)] + [(100.0, 8000)]
    trace = Trace(
        "mooncake",
        tuple(
            Request(index=i, arrival_s=at, prompt_tokens=tokens, answer_tokens=4, prefix=(i,))
            for i, (at, tokens) in enumerate(rows)
        ),
    )
    alone = run(trace, "expected_wait", 1, cheapest_first=False)
    took = {o.index: o.end_s - o.arrival_s for o in alone.outcomes}
    deadline_s = (max(took[i] for i in range(12)) + took[12]) / 2
    off = run(trace, "expected_wait", 1, cheapest_first=False, deadline_s=deadline_s)
    assert (off.timed_out, off.turned_away, len(off.outcomes)) == (1, 0, 12)
    on = run(trace, "expected_wait", 1, deadline_s=deadline_s)
    assert (on.timed_out, on.turned_away, on.refused, len(on.outcomes)) == (0, 1, 1, 12)
