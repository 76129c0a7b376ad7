"""The work admitted to one replica, in expected engine seconds: what its load report tells
the router's `wim` placement (`ReplicaLoad.backlog_s`, `running`).

Each job books its expected cost (`placement.policy.job_s`, the same profile the router
places with) when it starts; what is left of it is the cost less the time it has run, never
below zero, until it ends. Kept in memory and free of the engine: a load report must not wait
on a busy engine core. Free of Ray, so that it is tested without a replica.
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
    def __init__(self, profile: EngineProfile, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.clock = clock
        self._jobs: dict[int, tuple[float, float]] = {}  # id -> (start, expected seconds)
        self._ids = itertools.count()

    @property
    def running(self) -> int:
        return len(self._jobs)

    def seconds(self) -> float:
        """Expected seconds of work still ahead of a job that arrives now."""
        now = self.clock()
        return sum(max(0.0, cost - (now - start)) for start, cost in self._jobs.values())

    @contextmanager
    def job(self, work: Work, *, copy: bool = False) -> Iterator[float]:
        """Book `work` (a document read: `copy`) while the block runs; yields its cost."""
        here = ReplicaState("self", free_blocks=0, free_sessions=0, running=self.running)
        cost = job_s(self.profile, work, here, copy=copy)
        job = next(self._ids)
        self._jobs[job] = (self.clock(), cost)
        try:
            yield cost
        finally:
            del self._jobs[job]
