"""What a replay reports: each answered request, and the counts of what was not answered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Outcome:
    """One completed request."""

    index: int
    arrival_s: float
    first_token_s: float
    end_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: int


@dataclass
class RunResult:
    policy: str
    replicas: int
    requests: int
    outcomes: list[Outcome] = field(default_factory=list)
    too_large: int = 0  # requests no empty replica could hold: never placed
    # Refusals (each counted in `refused` or `retried` too) by cheapest-first admission.
    turned_away: int = 0
    refused: int = 0  # answered 429 with no retry left (a session's queries with its read)
    retried: int = 0  # refusals whose client sent the request again after the Retry-After
    # Stopped this long after it was sent, as the router stops a job: no answer. An answer
    # that ends later than this after its request's first send (a retry's clock starts at
    # its own send) is not goodput.
    deadline_s: float = math.inf
    timed_out: int = 0  # jobs stopped at their deadline (504 `deadline_exceeded`)
    offered_s: float = 0.0  # from the trace's first arrival to its last
    copies_opened: int = 0
    copies_retired: int = 0
    copies_reclaimed: int = 0  # of those, retired early to make room (`Replay._reclaim`)
    events: int = 0

    @classmethod
    def before(
        cls, policy: str, replicas: int, arrivals: Sequence[float], deadline_s: float
    ) -> RunResult:
        """A replay's result before it runs, of a trace whose requests arrive at `arrivals`."""
        offered_s = max(arrivals, default=0.0) - min(arrivals, default=0.0)
        return cls(policy, replicas, len(arrivals), deadline_s=deadline_s, offered_s=offered_s)
