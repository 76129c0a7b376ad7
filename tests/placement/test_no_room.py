"""What a placement that finds no room does next (`placement/no_room.py`), the one order the
router's `ReplicaFleet.place` and `wim sim`'s `Replay._booked` both take: loads asked again,
then a reclaim of spare copies, then a refusal."""

from __future__ import annotations

from wim_service.placement.no_room import NoRoomSteps, Step


def test_fresh_loads_first_then_a_reclaim_then_a_refusal() -> None:
    steps = NoRoomSteps(reclaims=True)
    assert steps.after(3) is Step.REFRESH
    assert steps.after(3) is Step.RECLAIM
    assert steps.after(3) is Step.REFUSE
    assert steps.after(3) is Step.REFUSE  # each step once per placement


def test_a_reclaim_that_closed_copies_polls_and_one_that_closed_none_refuses() -> None:
    assert NoRoomSteps.reclaimed(2) is Step.POLL
    assert NoRoomSteps.reclaimed(0) is Step.REFUSE


def test_without_a_reclaim_the_work_is_refused_after_fresh_loads() -> None:
    steps = NoRoomSteps(reclaims=False)
    assert [steps.after(2), steps.after(2)] == [Step.REFRESH, Step.REFUSE]


def test_with_no_live_replica_it_waits_while_it_may_and_asks_nothing_meanwhile() -> None:
    steps = NoRoomSteps(reclaims=True)
    assert steps.after(0, may_wait=True) is Step.WAIT
    assert steps.after(0, may_wait=True) is Step.WAIT
    assert steps.after(0) is Step.REFUSE  # the wait is over (`wim sim` never waits)
    # A replica came up meanwhile: its placement still takes every step, in order.
    steps = NoRoomSteps(reclaims=True)
    assert steps.after(0, may_wait=True) is Step.WAIT
    assert [steps.after(1), steps.after(1), steps.after(1)] == [
        Step.REFRESH,
        Step.RECLAIM,
        Step.REFUSE,
    ]
