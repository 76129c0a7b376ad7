"""When placement takes the replicas' load reports, for the live router and for `wim sim`.

The router asks every replica for its load once per poll (`load_poll_interval_s`) and places
in between on those reports and the work it booked since (`placement/ledger.py`). A decision
that must not rest on a poll's reports (a refusal, a copy's read) asks for them again first,
at most once per `FRESH_LOADS_S` however many decide at once: the router through its fleet's
`fresh_loads`, `wim sim` through `Fresh` at its own clock, so that a replay's burst is placed
on the loads the router would have seen.
"""

from __future__ import annotations

import math

# The router's poll interval by default (`RouterConfig.load_poll_interval_s`).
DEFAULT_LOAD_POLL_S = 2.0
# How old the loads a refusal or a copy is decided on may be.
FRESH_LOADS_S = 0.25


class Fresh:
    """Whether the reports must be asked again for a decision at `now`: not if they were
    asked for one at most `max_age_s` before (the router's `Recent(refresh, FRESH_LOADS_S)`;
    its polls do not count)."""

    def __init__(self, max_age_s: float = FRESH_LOADS_S) -> None:
        self.max_age_s = max_age_s
        self._asked = -math.inf

    def ask(self, now: float) -> bool:
        """Whether to ask for the reports for a decision at `now` (then noted as asked)."""
        if now - self._asked <= self.max_age_s:
            return False
        self._asked = now
        return True
