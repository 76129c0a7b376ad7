"""Cheapest-first admission: what `expected_wait` refuses at arrival while the fleet is short.

When work arrives faster than the engines answer it, some of it is refused (`429` with
Retry-After) whatever the policy does. Without a rule, what is refused is whatever arrives when
no replica has room: a new session's read or a plain request, cheap or not, while the queries of
held documents queue behind the costly ones. Refusing the costliest arrivals first answers more
requests in the same engine time. On hot-document traces at 8 replicas, where a hot long
document's WiM queries cost more engine time than all else, `wim sim` answered more with this
rule than with round robin or sticky on most traces, and changed nothing with room to spare
(docs/routing.md, "Cheapest-first admission at saturation").

The rule, one `CheapestFirst` per router (and per `wim sim` replay), at the router's clock:

- Each arrival (a query of a document session, a one-shot job, a plain request) is costed by
  `arrival_cost`: its engine seconds (`job_s`) on a representative replica running
  `RUNNING_JOBS` jobs, with the document held and no copy read, a plain request's longest
  cached prefix as the router believes it. Its retries arrive again; a session's read, a
  failover and a copy's read are not arrivals.
- The rule acts only while the fleet is short, and has been for a while. The fleet falls
  short (`fell_short`) when a placement finds no room or a replica refuses a call for want of
  it (the rule's own refusals do not count), and when a job runs past the request deadline
  and is stopped: with KV to spare, an overloaded fleet queues work until it times out
  instead of refusing it. The rule acts once the fleet has kept falling short, never more
  than `short_s` and `short_arrivals` arrivals apart, for at least `short_s` and
  `short_arrivals` arrivals. A burst that fills the fleet for a moment (after an idle spell,
  when few answers are in the books) is refused only what finds no room, as without the rule.
  Counting arrivals as well as seconds keeps a slow stream's spells whole: with one arrival
  every 13 s (Mooncake's trace stretched 40 times), 60 s spanned about five arrivals, a few
  admitted in a row broke every spell, and at one replica the rule never acted.
- An arrival some replica could start at once (`has_idle_replica`) is admitted, and with no
  answer in the window (every job timed out, say) the rule refuses nothing: it has no measure.
- Whatever the fleet's state, an arrival that would run past the request deadline even at the
  fleet's measured pace is refused at once (`Verdict.too_long_s`): its engine seconds, its
  cost times the pace (a low quantile, `PACE_QUANTILE`, of the answers' measured engine time
  over their cost), over the deadline. Such a job held a replica until the deadline stopped
  it and delayed what queued behind it; the pace, measured, keeps a profile of other hardware
  from refusing work its engines finish in time. The answers' time on their engines counts
  the engines' own queues too, so while the fleet is short (`Verdict.short`) such a refusal
  may be the load's as much as the job's: the router then answers `429` (retry later), else
  `413`.
- The water level is the largest cost at which the arrivals in the books (those of the last
  `window_s`, and at least the last `window_arrivals`), cheapest first, fit `slack` times the
  summed costs of the jobs answered since the oldest of them: the fleet's
  measured rate, in the estimate's own units, for the mix it is running. Arrivals costing more
  are refused; those within `MARGINAL_BAND` of it are admitted in the share that fits.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import PrefixCache, ReplicaState, Work

# The batch an arrival is costed in: a busy replica's, so that long answers (decoded beside
# others) weigh as they do at saturation, when the rule acts.
RUNNING_JOBS = 4
# Arrivals within this fraction of the water level (one document's queries, which cost about
# the same) are admitted in the share of them that fits, not all or none.
MARGINAL_BAND = 0.02
DEFAULT_WINDOW_S = 120.0
DEFAULT_SHORT_S = 60.0
# The arrivals admitted are at most this many times what the fleet answered. More lets in
# work that then queues toward the deadline: at 1.5, `wim sim` answered the most on
# hot-document traces at 8 replicas, but the p95 of what it answered went over round robin's
# on a quarter of them; at 1.4 it still answers more than either other policy and its p95
# stays under round robin's on more of them (docs/routing.md).
DEFAULT_SLACK = 1.4
# As many arrivals as the default seconds span at three a second: at that rate or faster the
# seconds decide, at slower ones the counts (see the module's doc).
DEFAULT_WINDOW_ARRIVALS = 240
DEFAULT_SHORT_ARRIVALS = 120
# The answers with a measured engine time the pace needs, and the quantile of their measured
# time over their cost it takes: a low one, so that only an arrival that even the fleet's
# quickest answers say would run past the deadline is refused for it.
PACE_ANSWERS = 10
PACE_QUANTILE = 0.1
# Whether `expected_wait` admits so (`RouterConfig.cheapest_first`, `SimSettings`).
DEFAULT_CHEAPEST_FIRST = True


@dataclass(frozen=True)
class AdmissionRule:
    """The rule's settings: the window its books keep, how long the fleet must have been short
    for it to act (and how long after it last fell short it still does), each in seconds and
    in arrivals (the longer of the two counts), and how much more than the fleet answered it
    admits."""

    window_s: float = DEFAULT_WINDOW_S
    short_s: float = DEFAULT_SHORT_S
    slack: float = DEFAULT_SLACK
    window_arrivals: int = DEFAULT_WINDOW_ARRIVALS
    short_arrivals: int = DEFAULT_SHORT_ARRIVALS


def arrival_cost(profile: EngineProfile, work: Work, prefixes: Iterable[PrefixCache]) -> float:
    """`work`'s engine seconds on a representative busy replica (see the module's doc)."""
    best = None
    if work.document is None and work.prefix:
        best = max(prefixes, key=lambda cache: cache.match(work.prefix), default=None)
    state = ReplicaState(
        "representative",
        free_blocks=1 << 30,
        free_sessions=1 << 10,
        running=RUNNING_JOBS,
        documents=frozenset([work.document]) if work.document is not None else frozenset(),
        prefix_cache=best,
    )
    return job_s(profile, work, state, copy=False)


def cheapest_first(
    policy: str, on: bool, rule: AdmissionRule, clock: Callable[[], float], deadline_s: float
) -> CheapestFirst | None:
    """The router's (and `wim sim`'s) admission under `policy`: cheapest first with
    `expected_wait` if `on` (`RouterConfig.cheapest_first`), else none. `deadline_s`: when the
    router stops a job (`request_timeout_s`)."""
    if not on or policy != "expected_wait":
        return None
    return CheapestFirst(rule, clock, deadline_s)


def has_idle_replica(loads: Iterable[LoadReport]) -> bool:
    """Whether some replica could start work at once, as placement sees the replicas: healthy,
    not draining, nothing running or queued there, a session slot free."""
    return any(
        load.healthy
        and not load.draining
        and load.running == 0
        and load.backlog_s <= 0
        and load.sessions < load.max_sessions
        for load in loads
    )


@dataclass(frozen=True)
class WaterLevel:
    """Arrivals costing under `low` are admitted, over `high` refused; between the two, the
    `share` of them that fits."""

    low: float = math.inf
    high: float = math.inf
    share: float = 1.0


OPEN = WaterLevel()  # everything admitted


@dataclass(frozen=True)
class Verdict:
    """Admission's answer on an arrival: its cost, whether it is admitted, and for one refused
    because it would run past the deadline, the engine seconds it is expected to take (None:
    refused, if so, for the water level) and whether the fleet was short then (its pace may
    then be its queues as much as its speed: the work may fit later)."""

    cost: float
    admitted: bool
    too_long_s: float | None = None
    short: bool = False


class CheapestFirst:
    """One router's books of arrivals and answers, and its admission decisions."""

    def __init__(
        self, rule: AdmissionRule, clock: Callable[[], float], deadline_s: float = math.inf
    ) -> None:
        self.rule = rule
        self.clock = clock
        self.deadline_s = deadline_s
        self._arrivals: deque[tuple[float, float]] = deque()  # (when, cost), oldest first
        self._count = 0  # arrivals booked since the rule began: the books' second clock
        self._costs: list[float] = []  # the window's arrival costs, sorted
        # (when, cost, measured engine seconds over cost if known) of the jobs answered
        self._answers: deque[tuple[float, float, float | None]] = deque()
        self._answered_s = 0.0  # their summed cost
        # When the fleet last fell short, and when its current spell of falling short began:
        # each as (seconds, arrivals) on the rule's two clocks.
        self._short_at = (-math.inf, -math.inf)
        self._short_since = (math.inf, math.inf)
        self._credit = 0.0  # the marginal band's admissions owed

    def admit(self, ledger: Ledger, work: Work) -> Verdict:
        """Judge `work`'s arrival, costed (`arrival_cost`): refused if it would run past the
        deadline at the fleet's pace, else booked and judged on the replicas as `ledger` sees
        them (`has_idle_replica`). The router and `wim sim` both ask this."""
        cost = arrival_cost(ledger.profile, work, ledger.prefixes.values())
        now = self.clock()
        self._forget(now)  # the pace of the answers still in the books
        pace = self.pace()
        if pace is not None and cost * pace > self.deadline_s:
            return Verdict(cost, admitted=False, too_long_s=cost * pace, short=self.short(now))
        return Verdict(cost, self.arrive(cost, idle=has_idle_replica(ledger.loads.values())))

    def arrive(self, cost: float, *, idle: bool = False) -> bool:
        """Book an arrival costing `cost`: whether it is admitted. `idle`: some replica could
        start it at once (`has_idle_replica`): admitted whatever the level, as refusing it
        would leave that replica idle for nothing."""
        now = self.clock()
        self._count += 1
        self._arrivals.append((now, cost))
        bisect.insort(self._costs, cost)
        self._forget(now)
        if idle:
            return True
        level = self.level(now)
        if cost < level.low:
            return True
        if cost > level.high:
            return False
        self._credit += level.share
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    @property
    def arrivals(self) -> int:
        """The arrivals in the books: those of the last `window_s` as of the latest, and at
        least the last `window_arrivals`."""
        return len(self._arrivals)

    def answered(self, cost: float, took_s: float | None = None) -> None:
        """A job admitted at `cost` was answered, in `took_s` seconds on its engine if known
        (the engine's own measure, its wait for admission left out)."""
        ratio = took_s / cost if took_s is not None and cost > 0 else None
        self._answers.append((self.clock(), cost, ratio))
        self._answered_s += cost

    def pace(self) -> float | None:
        """The engine seconds an estimated second takes, as the answers in the books measured
        it (their `PACE_QUANTILE`); None with fewer than `PACE_ANSWERS` measured."""
        ratios = sorted(ratio for _, _, ratio in self._answers if ratio is not None)
        if len(ratios) < PACE_ANSWERS:
            return None
        return ratios[int(PACE_QUANTILE * (len(ratios) - 1))]

    def fell_short(self) -> None:
        """The fleet fell short: a placement found no room on any replica, a replica refused
        a call for want of room, or a job was stopped at the request deadline."""
        now = (self.clock(), self._count)
        if not self._within_short(self._short_at, now):  # a new spell begins
            self._short_since = now
        self._short_at = now

    def _within_short(self, then: tuple[float, float], now: tuple[float, float]) -> bool:
        """Whether `then` is at most `short_s`, or fewer than `short_arrivals` arrivals, before
        `now`."""
        return now[0] - then[0] <= self.rule.short_s or now[1] - then[1] < self.rule.short_arrivals

    def short(self, now: float) -> bool:
        """Whether the fleet has kept falling short long enough, as of `now`, for the rule to
        act (see the module's doc)."""
        rule, at = self.rule, (now, self._count)
        spell_s, spell_arrivals = at[0] - self._short_since[0], at[1] - self._short_since[1]
        if not self._within_short(self._short_at, at):
            return False
        return spell_s >= rule.short_s and spell_arrivals >= rule.short_arrivals

    def level(self, now: float) -> WaterLevel:
        """The water level at `now` (`OPEN` while the fleet is not short)."""
        if not self.short(now):
            return OPEN
        rule = self.rule
        self._forget(now)
        if not self._answers:  # no measure of what the fleet answers: nothing to refuse by
            return OPEN
        capacity = rule.slack * self._answered_s
        below = 0.0
        for cost in self._costs:
            if below + cost > capacity:
                return self._band(cost, capacity)
            below += cost
        return OPEN

    def _band(self, cost: float, capacity: float) -> WaterLevel:
        """The marginal band around `cost`, the first arrival cost that does not fit."""
        low, high = cost * (1 - MARGINAL_BAND), cost * (1 + MARGINAL_BAND)
        start = bisect.bisect_left(self._costs, low)
        end = bisect.bisect_right(self._costs, high)
        below = sum(self._costs[:start])
        band = sum(self._costs[start:end])
        share = min(1.0, max(0.0, (capacity - below) / band)) if band > 0 else 0.0
        return WaterLevel(low, high, share)

    def _forget(self, now: float) -> None:
        """Drop what left the window."""
        since = now - self.rule.window_s
        while len(self._arrivals) > self.rule.window_arrivals and self._arrivals[0][0] < since:
            _, cost = self._arrivals.popleft()
            del self._costs[bisect.bisect_left(self._costs, cost)]
        if self._arrivals:  # the answers of the span the arrivals kept cover
            since = min(since, self._arrivals[0][0])
        while self._answers and self._answers[0][0] < since:
            self._answered_s -= self._answers.popleft()[1]
