"""A replica's backlog: each job's expected cost booked while it runs, what is left of it
reported (`placement/backlog.py`)."""

from __future__ import annotations

import pytest

from wim_service.placement.backlog import Backlog
from wim_service.placement.profile import EngineProfile
from wim_service.serving.replica.work import plain_work, session_work
from wim_service.wim.options import WiMOptions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_job_counts_its_expected_cost_less_its_time_run_until_it_ends() -> None:
    clock = Clock()
    backlog = Backlog(EngineProfile.load(), clock)
    assert (backlog.seconds(), backlog.running) == (0.0, 0)
    with backlog.job(plain_work(2000, 16, 0)) as cost:
        assert cost > 0 and backlog.seconds() == cost and backlog.running == 1
        clock.now += cost / 2
        assert backlog.seconds() == pytest.approx(cost / 2)
        clock.now += cost  # running past its estimate: nothing left, never less
        assert backlog.seconds() == 0.0
    assert (backlog.seconds(), backlog.running) == (0.0, 0)


def test_a_query_on_a_copy_held_costs_less_than_one_that_reads_the_copy_first() -> None:
    backlog = Backlog(EngineProfile.load(), Clock())
    query = session_work("d", 3000, 0, WiMOptions(), query="Why?", segments=3)
    with backlog.job(query) as held:
        pass
    with backlog.job(query, copy=True) as copied:
        pass
    assert copied > held > 0
