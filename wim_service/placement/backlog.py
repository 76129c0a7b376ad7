"""A replica's backlog: the work admitted to it, in expected engine seconds. What a live replica
reports to the router (`ReplicaLoad.backlog_s`, `running`) and what a `wim sim` engine reports
to placement, by this one definition, so that a replay places on the backlogs the service has.

Each job books its expected cost (`placement.policy.job_s`, the same profile the router places
with) when it starts; what is left of it is the cost less the time it has run, never below
zero, until it ends. Kept in memory and free of the engine: a load report must not wait on a
busy engine core.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from wim_service.placement.policy import job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import ReplicaState, Work


class Backlog:
    """The jobs admitted to one replica. Times are `clock()`'s unless given (`now`: the
    simulator's time)."""

    def __init__(self, profile: EngineProfile, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.clock = clock
        self._jobs: dict[int, tuple[float, float]] = {}  # id -> (start, expected seconds)
        self._ids = itertools.count()

    @property
    def running(self) -> int:
        return len(self._jobs)

    def seconds(self, now: float | None = None) -> float:
        """Expected seconds of work still ahead of a job that arrives now."""
        now = self.clock() if now is None else now
        return sum(max(0.0, cost - (now - start)) for start, cost in self._jobs.values())

    def book(self, work: Work, *, copy: bool = False, now: float | None = None) -> int:
        """Book `work` (a document read, or a query that reads its copy first: `copy`) from
        `now` until `end(job)`: the job's id."""
        here = ReplicaState("self", free_blocks=0, free_sessions=0, running=self.running)
        job = next(self._ids)
        self._jobs[job] = (
            self.clock() if now is None else now,
            job_s(self.profile, work, here, copy=copy),
        )
        return job

    def cost(self, job: int) -> float:
        """The expected seconds `job` was booked with."""
        return self._jobs[job][1]

    def end(self, job: int) -> None:
        del self._jobs[job]

    @contextmanager
    def job(self, work: Work, *, copy: bool = False) -> Iterator[float]:
        """Book `work` while the block runs; yields its cost."""
        job = self.book(work, copy=copy)
        try:
            yield self.cost(job)
        finally:
            self.end(job)
