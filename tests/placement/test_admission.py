"""Cheapest-first admission (`placement/admission.py`) at a fake clock: when it acts, the water
level and the marginal band's share worked out by hand, the window its books keep, and the cost
of an arrival on a representative busy replica."""

from __future__ import annotations

import math

import pytest

from tests.fakes.profile import PROFILE
from wim_service.placement import admission
from wim_service.placement.admission import (
    DEFAULT_CHEAPEST_FIRST,
    OPEN,
    PACE_ANSWERS,
    AdmissionRule,
    CheapestFirst,
    Verdict,
    WaterLevel,
    arrival_cost,
    cheapest_first,
    has_idle_replica,
)
from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import ExpectedWait, fits_holder, job_s, with_room
from wim_service.placement.state import PrefixCache, ReplicaState, Work


class Clock:
    """The router's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seconds_rule(**settings: float) -> AdmissionRule:
    """A rule whose spans are its seconds only (no least number of arrivals)."""
    return AdmissionRule(window_arrivals=0, short_arrivals=0, **settings)


def short_fleet(slack: float = 1.5, window_s: float = 10.0) -> tuple[CheapestFirst, Clock]:
    """A rule that acts: placements found no room at 0 s and at 20 s (`short_s` apart, so the
    fleet has been short for `short_s`), its clock at 20 s, nothing in its books."""
    clock = Clock()
    rule = CheapestFirst(seconds_rule(window_s=window_s, short_s=20.0, slack=slack), clock)
    rule.fell_short()
    clock.now = 20.0
    rule.fell_short()
    return rule, clock


def figures(level: WaterLevel) -> tuple[float, float, float]:
    return (level.low, level.high, level.share)


def answer(rule: CheapestFirst, *costs: float) -> None:
    for cost in costs:
        rule.answered(cost)


# -- when the rule acts -----------------------------------------------------------------------


def test_an_arrival_a_replica_could_start_at_once_is_admitted_and_booked() -> None:
    rule, _ = short_fleet(slack=1.0)
    answer(rule, 1.0)
    assert not rule.arrive(5.0)  # 1 s answered leaves no room for 5 s
    assert rule.arrive(5.0, idle=True)
    # Booked all the same: two 5 s arrivals in the books now, so the band holds 10 s.
    assert figures(rule.level(20.0)) == pytest.approx((4.9, 5.1, 0.1))


def test_an_idle_replica_is_healthy_undrained_unloaded_with_a_slot_free() -> None:
    idle = LoadReport("a", capacity_blocks=10, reserved_blocks=0, sessions=0, max_sessions=1)
    assert has_idle_replica([idle])
    assert not has_idle_replica([])
    for busy in (
        LoadReport("a", 10, 0, sessions=0, max_sessions=1, healthy=False),
        LoadReport("a", 10, 0, sessions=0, max_sessions=1, draining=True),
        LoadReport("a", 10, 0, sessions=0, max_sessions=1, running=1),
        LoadReport("a", 10, 0, sessions=0, max_sessions=1, backlog_s=0.5),
        LoadReport("a", 10, 0, sessions=1, max_sessions=1),
    ):
        assert not has_idle_replica([busy])
        assert has_idle_replica([busy, idle])


def test_the_defaults_are_the_documented_window_shortness_and_slack() -> None:
    # The module's doc and the router's configuration state these figures.
    assert AdmissionRule() == AdmissionRule(
        window_s=120.0, short_s=60.0, slack=1.4, window_arrivals=240, short_arrivals=120
    )
    assert DEFAULT_CHEAPEST_FIRST is True


def test_the_level_is_open_with_nothing_in_the_books_however_short_the_fleet() -> None:
    rule, clock = short_fleet()
    assert rule.level(clock.now) is OPEN
    assert WaterLevel(math.inf, math.inf, 1.0) == OPEN


def test_the_rule_acts_once_placements_have_kept_finding_no_room_for_short_s() -> None:
    # A 1 s answer (1.5 s at slack 1.5) leaves no room for a 50 s arrival once the rule acts.
    clock = Clock()
    rule = CheapestFirst(seconds_rule(window_s=10.0, short_s=5.0), clock)
    assert rule.arrive(1.0)
    clock.now = 1.0
    rule.answered(1.0)
    rule.fell_short()  # the spell begins
    clock.now = 3.0
    assert rule.arrive(50.0)  # short for 2 s only
    clock.now = 4.0
    rule.fell_short()
    clock.now = 5.9
    assert rule.arrive(50.0)
    clock.now = 6.0  # exactly `short_s` into the spell
    assert not rule.arrive(50.0)
    # More than `short_s` without a no-room ends the spell: the next one begins another.
    clock.now = 20.0
    rule.fell_short()
    clock.now = 24.0
    assert rule.arrive(50.0)
    rule.answered(1.0)
    rule.fell_short()
    clock.now = 29.0  # exactly `short_s` after the last: the spell since 20 s goes on
    rule.fell_short()
    assert not rule.arrive(50.0)


def test_everything_is_admitted_when_no_placement_found_no_room_lately() -> None:
    clock = Clock()
    rule = CheapestFirst(seconds_rule(window_s=10.0, short_s=5.0), clock)
    assert rule.arrive(1.0)
    clock.now = 30.0  # little answered, never short: all admitted
    rule.answered(1.0)
    assert rule.arrive(100.0) and rule.arrive(100.0)
    rule.fell_short()
    clock.now = 35.0
    rule.fell_short()  # short for `short_s`
    assert not rule.arrive(100.0)
    clock.now = 40.0  # exactly `short_s` after the last no-room: still short
    assert not rule.arrive(100.0)
    clock.now = 40.5  # past it: open again
    assert rule.arrive(100.0)
    assert rule.level(40.5) is OPEN


# -- the water level --------------------------------------------------------------------------


def test_arrivals_that_fit_slack_times_the_answered_cost_exactly_are_all_admitted() -> None:
    # Answers 4 + 6 = 10, slack 1.5: 15 s of arrivals fit. 5, 4, 3, 2, 1 sum to 15, so each
    # is admitted, the costliest first; a second 5 no longer fits whole.
    rule, clock = short_fleet(slack=1.5)
    answer(rule, 4.0, 6.0)
    assert [rule.arrive(cost) for cost in (5.0, 4.0, 3.0, 2.0, 1.0)] == [True] * 5
    assert rule.level(clock.now) is OPEN
    # 1 + 2 + 3 + 4 = 10 fit below the two 5s, which fit 5 of their 10: half of them, so
    # half an admission is owed.
    assert not rule.arrive(5.0)
    assert figures(rule.level(clock.now)) == pytest.approx((4.9, 5.1, 0.5))
    # A third 5: the band is 15 s, of which 5 fit; with the half owed, not yet one.
    assert not rule.arrive(5.0)
    assert rule.level(clock.now).share == pytest.approx(1 / 3)


def test_the_costliest_arrivals_are_refused_once_the_cheaper_ones_fill_the_level() -> None:
    # Answers 2 + 4 = 6, slack 1.5: 9 s fit. Arrivals 1, 2, 3 (6 s) fit whole; with 4 they
    # would take 10: the level is 4, its band 3.92 to 4.08, of which 9 - 6 = 3 of 4 fits.
    rule, clock = short_fleet(slack=1.5)
    answer(rule, 2.0, 4.0)
    assert [rule.arrive(cost) for cost in (1.0, 2.0, 3.0)] == [True, True, True]
    assert not rule.arrive(4.0)  # in the band: three quarters owed, not yet one
    assert figures(rule.level(clock.now)) == pytest.approx((3.92, 4.08, 0.75))
    assert not rule.arrive(5.0)  # above the band
    # A cheap one still fits below: 1, 1, 2, 3 (7 s) leave 2 of the band's 4.
    assert rule.arrive(1.0)
    assert rule.level(clock.now).share == pytest.approx(0.5)
    # Another 4: the band is 8 s, of which 2 fit (a quarter), and with the three quarters
    # owed since the first 4, one whole admission is owed: it is admitted.
    assert rule.arrive(4.0)


def test_the_marginal_band_is_admitted_in_the_share_that_fits() -> None:
    # Slack 1: every 0.2 s arrival of one document's queries comes after a 0.1 s answer, so
    # the band holds twice what fits whenever one arrives: every second one is admitted.
    # Costs within 2% of the level (0.197 to 0.203 s) are the same band.
    rule, clock = short_fleet(slack=1.0)
    admitted = []
    for cost in (0.2, 0.197, 0.2, 0.203, 0.2, 0.2):
        answer(rule, cost / 2)
        admitted.append(rule.arrive(cost))
        assert rule.level(clock.now).share == pytest.approx(0.5)
    assert admitted == [False, True, False, True, False, True]


def test_a_cost_exactly_at_either_edge_of_the_band_is_in_the_band() -> None:
    # Low edge: 60 s answered at slack 1. 50 arrives and fits; then 49 (50 x 0.98): 49 fits
    # below, 50 no longer does, so the band is 49 to 51: 99 s of which 60 fit. 49 is in it,
    # admitted in that share: 0.61 of an admission owed, not yet one.
    rule, clock = short_fleet(slack=1.0)
    answer(rule, 60.0)
    assert rule.arrive(50.0)
    assert not rule.arrive(49.0)
    assert figures(rule.level(clock.now)) == (49.0, 51.0, pytest.approx(60 / 99))
    # High edge: 40 s answered. 50 does not fit: 0.8 of it owed. Then 51 (50 x 1.02) is in
    # the band 49 to 51 (101 s, of which 40 fit): 0.8 + 0.4 owed, one admission.
    rule, clock = short_fleet(slack=1.0)
    answer(rule, 40.0)
    assert not rule.arrive(50.0)
    assert rule.arrive(51.0)
    assert figures(rule.level(clock.now)) == (49.0, 51.0, pytest.approx(40 / 101))


def test_a_cost_just_outside_the_band_is_refused_above_and_admitted_below() -> None:
    # Answers of 10 s at slack 1 fit 10 s: arrivals 10 and 10 make the band 9.8 to 10.2.
    rule, clock = short_fleet(slack=1.0)
    answer(rule, 10.0)
    assert rule.arrive(10.0)
    assert not rule.arrive(10.0)  # half the band fits: half an admission owed
    assert rule.arrive(9.7)  # below the band: 9.7 fits whole
    assert not rule.arrive(10.3)  # above it
    assert rule.level(clock.now).high == pytest.approx(10.2)


def slow_stream(rule: CheapestFirst, clock: Clock, arrivals: int) -> list[bool]:
    """One arrival every 13 s, costing 50 s each third and 1 s otherwise; every third, a
    10 s answer and the fleet falling short (39 s apart): whether each was admitted."""
    admitted = []
    for n in range(arrivals):
        clock.now = 13.0 * n
        admitted.append(rule.arrive(50.0 if n % 3 == 2 else 1.0))
        if n % 3 == 0:
            rule.answered(10.0)
            rule.fell_short()
    return admitted


def test_a_slow_stream_stays_short_within_short_arrivals_and_the_rule_acts() -> None:
    # Falling short 39 s apart, over `short_s` (20 s) but within `short_arrivals` (4): one
    # spell, from the first arrival. It acts once it has lasted 20 s and 4 arrivals, and then
    # refuses the 50 s arrivals (two 10 s answers at slack 1.5 carry the 1 s ones only).
    clock = Clock()
    rule = CheapestFirst(AdmissionRule(window_s=10.0, short_s=20.0, short_arrivals=4), clock)
    admitted = slow_stream(rule, clock, 9)
    assert admitted == [True, True, True, True, True, False, True, True, False]
    # Counted in seconds only, every fall starts a spell that ends before it is 20 s old.
    clock = Clock()
    seconds_only = CheapestFirst(seconds_rule(window_s=10.0, short_s=20.0), clock)
    assert all(slow_stream(seconds_only, clock, 9))
    # `short_arrivals` arrivals and `short_s` without falling short end the spell: the last
    # fall was at n = 6.
    clock.now = 13.0 * 9
    assert rule.arrive(1.0) and rule.level(clock.now) is not OPEN  # 3 arrivals on
    clock.now = 13.0 * 10
    assert rule.arrive(50.0) and rule.level(clock.now) is OPEN  # 4 arrivals on


def test_the_books_keep_at_least_window_arrivals_however_old() -> None:
    clock = Clock()
    rule = CheapestFirst(AdmissionRule(window_s=10.0, window_arrivals=3), clock)
    for n in range(5):
        clock.now = 100.0 * n
        rule.arrive(1.0)
    assert rule.arrivals == 3  # 400 s old and more, kept: the window's seconds hold one


# -- the window -------------------------------------------------------------------------------


def test_arrivals_and_answers_leave_the_books_after_one_window() -> None:
    clock = Clock()
    rule = CheapestFirst(seconds_rule(window_s=10.0, short_s=10.0, slack=1.0), clock)
    rule.fell_short()
    assert rule.arrive(8.0)  # t = 0
    clock.now = 5.0
    rule.answered(4.0)
    clock.now = 10.0
    rule.fell_short()  # short since 0 s: the rule acts
    # The arrival is exactly one window old: still in the books. 4 s answered fit half of it.
    assert figures(rule.level(10.0)) == pytest.approx((7.84, 8.16, 0.5))
    assert rule.level(10.5) is OPEN  # it has left: nothing in the books to refuse
    clock.now = 15.0  # the answer is exactly one window old: it still counts
    assert rule.arrive(3.0)
    clock.now = 15.5  # it has left: with nothing answered the rule has no measure
    assert rule.arrive(3.0)
    assert rule.level(15.5) is OPEN
    # Answers at 15.5 bring the level back: 6 s answered fit both 3s.
    answer(rule, 3.0, 3.0)
    assert rule.level(15.5) is OPEN


def test_the_level_forgets_what_left_the_window_without_an_arrival() -> None:
    rule, clock = short_fleet(slack=1.0)
    answer(rule, 1.0)
    assert not rule.arrive(5.0)
    assert rule.level(clock.now) != OPEN
    assert rule.level(clock.now + 10.5) is OPEN


# -- the cost of an arrival -------------------------------------------------------------------


def test_a_querys_cost_is_its_job_on_a_busy_holder_without_a_read() -> None:
    query = Work(
        prompt_tokens=3040,
        answer_tokens=16,
        document="a",
        document_tokens=3000,
        margins=3,
        margin_tokens=24,
    )
    # The test profile's figures, four jobs running: the query's 40 tokens and the 50 of the
    # answers started early over the document's 3,000 (no read), three margins' 60-token
    # prompts, their 24 tokens decoded in a batch of 4 + 3 over 3 x 3,000 tokens, then the
    # answer's 16 in a batch of 5 over 3,056.
    answer = 0.02 + 90 * (3e-4 + 1e-8 * (3000 + 45))
    prompts = 0.02 + 180 * (3e-4 + 1e-8 * (3000 + 90))
    margins = 24 * (0.02 + 7 * 1e-3 + 9000 * 1e-7)
    decode = 16 * (0.02 + 5 * 1e-3 + 3056 * 1e-7)
    assert arrival_cost(PROFILE, query, []) == pytest.approx(
        answer + prompts + margins + decode, rel=1e-12
    )


def test_a_plain_requests_cost_counts_the_best_cached_prefix_as_the_router_believes() -> None:
    # 2,000 tokens in blocks of 512: one cache holds its first block, another its first three.
    plain = Work(prompt_tokens=2000, answer_tokens=8, prefix=(1, 2, 3, 4))
    one, three, none = PrefixCache(100), PrefixCache(100), PrefixCache(100)
    one.insert((1, 9))
    three.insert((1, 2, 3))
    none.insert((7,))
    # 2000 - 3 x 512 = 464 tokens prefilled over 1,536 cached, then 8 tokens decoded in a
    # batch of five (four running) over 2,008.
    prefill = 0.02 + 464 * (3e-4 + 1e-8 * (1536 + 232))
    decode = 8 * (0.02 + 5 * 1e-3 + 2008 * 1e-7)
    cost = arrival_cost(PROFILE, plain, [one, three, none])
    assert cost == pytest.approx(prefill + decode, rel=1e-12)
    assert cost < arrival_cost(PROFILE, plain, [one]) < arrival_cost(PROFILE, plain, [])
    # Without a prefix no cache counts: the whole prompt is prefilled.
    whole = Work(prompt_tokens=2000, answer_tokens=8)
    prefill = 0.02 + 2000 * (3e-4 + 1e-8 * 1000)
    assert arrival_cost(PROFILE, whole, [three]) == pytest.approx(prefill + decode, rel=1e-12)
    # The same as the policy's cost of the job on such a replica.
    state = ReplicaState("r", free_blocks=0, free_sessions=0, running=4, prefix_cache=three)
    assert cost == job_s(PROFILE, plain, state)


def test_the_representative_replica_holds_the_document_has_room_and_runs_four_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What `job_s` is asked: the document's own holder (its query reads no copy), room for
    # anything, four jobs running; a request without a document holds none. (`job_s` reads
    # only some of these today; the representative is what the module's doc promises.)
    asked: list[tuple[ReplicaState, object]] = []

    def spy(profile: object, work: Work, state: ReplicaState, *, copy: object) -> float:
        asked.append((state, copy))
        return 1.0

    monkeypatch.setattr(admission, "job_s", spy)
    query = Work(prompt_tokens=3040, answer_tokens=16, document="a", document_tokens=3000)
    plain = Work(prompt_tokens=2000, answer_tokens=8, kv_blocks=1 << 20, takes_session=True)
    arrival_cost(PROFILE, query, [])
    arrival_cost(PROFILE, plain, [])
    (held, copy), (none, _) = asked
    assert copy is False
    assert (held.documents, none.documents) == (frozenset({"a"}), frozenset())
    assert (held.running, held.draining, held.backlog_s) == (4, False, 0.0)
    for state in (held, none):
        assert fits_holder(plain, state) and with_room(plain, [state]) == [state]


# -- too long for the deadline ----------------------------------------------------------------


def test_the_pace_is_a_low_quantile_of_the_answers_measured_time_over_their_cost() -> None:
    clock = Clock()
    rule = CheapestFirst(AdmissionRule(), clock)
    rule.answered(1.0)  # no measure: not in the pace
    for took in range(PACE_ANSWERS - 1):
        rule.answered(2.0, took_s=2.0 * (took + 1))  # 1x, 2x, ... the cost
    assert rule.pace() is None  # too few measured
    rule.answered(4.0, took_s=2.0)  # 0.5x
    assert rule.pace() == 0.5  # the 10th percentile of ten: the least
    for _ in range(PACE_ANSWERS):
        rule.answered(1.0, took_s=3.0)
    # Twenty: 0.5, 1, 2, 3 ... The 10th percentile is at index 1.9, rounded down: 1.
    assert rule.pace() == 1.0
    clock.now = 121.0  # the answers left the window with their arrivals' span
    rule.arrive(1.0)
    assert rule.pace() is None


def paced(
    took_over_cost: float, deadline_s: float, settings: AdmissionRule | None = None
) -> tuple[CheapestFirst, Ledger]:
    """A rule (of `settings`, the defaults if None) whose books hold `PACE_ANSWERS` answers
    measured at `took_over_cost` their cost, with `deadline_s`, and an empty fleet's ledger (no
    replica: none idle)."""
    clock = Clock()
    rule = CheapestFirst(settings or AdmissionRule(), clock, deadline_s)
    for _ in range(PACE_ANSWERS):
        rule.answered(1.0, took_s=took_over_cost)
    return rule, Ledger(ExpectedWait(PROFILE), PROFILE, clock=clock)


def test_an_arrival_that_would_run_past_the_deadline_at_the_pace_is_refused_at_once() -> None:
    plain = Work(prompt_tokens=2000, answer_tokens=8)
    cost = arrival_cost(PROFILE, plain, [])
    # At twice the profile's pace the job takes 2 x cost: past a deadline of 1.9 x cost, not
    # past one of 2.1 x; at half the pace, past neither.
    rule, ledger = paced(2.0, deadline_s=1.9 * cost)
    verdict = rule.admit(ledger, plain)
    assert verdict == Verdict(cost, admitted=False, too_long_s=pytest.approx(2.0 * cost))
    assert rule.arrivals == 0  # refused before it is booked: it is not the fleet's load
    rule, ledger = paced(2.0, deadline_s=2.1 * cost)
    assert rule.admit(ledger, plain) == Verdict(cost, admitted=True)
    assert rule.arrivals == 1
    rule, ledger = paced(0.5, deadline_s=1.9 * cost)
    assert rule.admit(ledger, plain) == Verdict(cost, admitted=True)
    # Refused so while the fleet is short, the verdict says so.
    rule, ledger = paced(2.0, deadline_s=1.9 * cost, settings=seconds_rule(short_s=60.0))
    assert not rule.admit(ledger, plain).short
    for now in (0.0, 60.0):  # falling short for `short_s`
        rule.clock.now = now  # type: ignore[attr-defined]
        rule.fell_short()
    assert rule.admit(ledger, plain).short
    # With no measured pace nothing is refused for it, however long the job.
    rule = CheapestFirst(AdmissionRule(), Clock(), deadline_s=1e-3)
    assert rule.admit(ledger, plain).admitted


def test_the_router_and_the_simulator_give_the_rule_their_deadline() -> None:
    rule = cheapest_first("expected_wait", True, AdmissionRule(), Clock(), 900.0)
    assert rule is not None and rule.deadline_s == 900.0
    assert cheapest_first("round_robin", True, AdmissionRule(), Clock(), 900.0) is None
    assert cheapest_first("expected_wait", False, AdmissionRule(), Clock(), 900.0) is None


def test_the_pace_counts_an_answer_without_cost_out_and_its_quantile_moves_at_eleven() -> None:
    rule = CheapestFirst(AdmissionRule(), Clock())
    rule.answered(0.0, took_s=1.0)  # no cost to measure against: booked, not in the pace
    for took in range(1, 11):
        rule.answered(1.0, took_s=float(took))
    assert rule.pace() == 1.0  # ten: index 0.9, the least
    rule.answered(1.0, took_s=0.5)
    assert rule.pace() == 1.0  # eleven: index 1.0, the second least (0.5 is the least)


def test_a_job_taking_exactly_the_deadline_is_admitted() -> None:
    plain = Work(prompt_tokens=2000, answer_tokens=8)
    cost = arrival_cost(PROFILE, plain, [])
    rule, ledger = paced(2.0, deadline_s=2.0 * cost)
    assert rule.admit(ledger, plain) == Verdict(cost, admitted=True)


def test_admit_asks_whether_a_replica_in_the_ledger_could_start_it_at_once() -> None:
    # Short, one 1 s answer at slack 1: a request of 20,000 tokens (several seconds) is over
    # the level, and admitted only while the ledger's replica is idle.
    rule, clock = short_fleet(slack=1.0)
    answer(rule, 1.0)
    ledger = Ledger(ExpectedWait(PROFILE), PROFILE, clock=clock)
    idle = LoadReport("a", capacity_blocks=10, reserved_blocks=0, sessions=0, max_sessions=1)
    busy = LoadReport("a", 10, 0, sessions=0, max_sessions=1, running=1)
    plain = Work(prompt_tokens=20_000, answer_tokens=8)
    for report, admitted in ((busy, False), (idle, True)):
        ledger.take_reports(["a"], [report])
        assert rule.admit(ledger, plain).admitted is admitted


def test_an_answer_that_left_the_window_no_longer_counts_in_the_level() -> None:
    # Two 4 s answers, the first at 0 s: once it has left, 4 s answered (not 8, nor 0) sets
    # the level: at slack 1, two 3 s arrivals fit in two thirds.
    clock = Clock()
    rule = CheapestFirst(seconds_rule(window_s=10.0, short_s=10.0, slack=1.0), clock)
    rule.fell_short()
    rule.answered(4.0)
    clock.now = 8.0
    rule.answered(4.0)
    clock.now = 10.0
    rule.fell_short()
    clock.now = 10.5
    rule.fell_short()
    rule.arrive(3.0)
    rule.arrive(3.0)
    assert figures(rule.level(10.5)) == pytest.approx((2.94, 3.06, 2 / 3))
