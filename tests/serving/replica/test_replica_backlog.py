"""A replica's backlog: each job's expected cost booked while it runs, what is left of it
reported (`placement/backlog.py`)."""

from __future__ import annotations

import pytest

from tests.fakes.profile import PROFILE
from wim_service.placement.backlog import Backlog
from wim_service.placement.policy import job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import ReplicaState
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


def test_a_job_is_booked_at_its_cost_in_the_batch_already_running_and_without_a_read() -> None:
    backlog = Backlog(PROFILE, Clock())
    query = session_work("d", 3000, 0, WiMOptions(), query="Why?", segments=3)
    first, _, third = (backlog.book(query) for _ in range(3))
    beside_two = ReplicaState("r", free_blocks=0, free_sessions=0, running=2)
    assert backlog.cost(third) == pytest.approx(job_s(PROFILE, query, beside_two), rel=1e-12)
    assert backlog.cost(third) > backlog.cost(first)  # the first ran alone: a smaller batch
    copied = backlog.book(query, copy=True)
    beside_three = ReplicaState("r", free_blocks=0, free_sessions=0, running=3)
    expected = job_s(PROFILE, query, beside_three, copy=True)
    assert backlog.cost(copied) == pytest.approx(expected, rel=1e-12)
