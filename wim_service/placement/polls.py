"""When placement takes the replicas' load reports, for the live router and for `wim sim`.

The router asks every replica for its load once per poll (`load_poll_interval_s`) and places
in between on those reports and the work it booked since (`placement/ledger.py`). A decision
that must not rest on a poll's reports (a refusal, a copy's read) asks for them again first,
at most once per `FRESH_LOADS_S` however many decide at once (`Fresh`): the router through its
fleet's `fresh_loads`, `wim sim` at its own clock, so that a replay's burst is placed on the
loads the router would have seen.
"""

from __future__ import annotations

import math

# The router's poll interval by default (`RouterConfig.load_poll_interval_s`).
DEFAULT_LOAD_POLL_S = 2.0
# How old the loads a refusal or a copy is decided on may be.
FRESH_LOADS_S = 0.25


class Fresh:
    """Whether what was taken for a decision is fresh enough for the next: taken at most
    `max_age_s` before. One rule for the router and `wim sim`: the router's `Recent` keeps
    what it fetched so (its fleet's `fresh_loads`: the loads a refusal or a copy is decided
    on, `FRESH_LOADS_S`), and `wim sim` its asks for the engines' reports at its own clock
    (its polls, as the router's, do not count)."""

    def __init__(self, max_age_s: float = FRESH_LOADS_S) -> None:
        self.max_age_s = max_age_s
        self._taken_s = -math.inf  # nothing taken yet

    def holds(self, now: float) -> bool:
        """Whether what was last taken is still fresh at `now`."""
        return now - self._taken_s <= self.max_age_s

    def took(self, now: float) -> None:
        """It was taken (again) at `now`."""
        self._taken_s = now
