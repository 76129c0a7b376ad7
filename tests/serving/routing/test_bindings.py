"""The router's ledger (`placement/ledger.py`) over the replicas' wire reports: sticky sessions,
bounded-load placement, tolerant load updates (under the `sticky` policy: the most free KV among
the replicas that fit)."""

from __future__ import annotations

import pytest

from wim_service.placement.ledger import Ledger
from wim_service.placement.policy import ExpectedWait, Sticky
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Work
from wim_service.serving.replica.contracts import ReplicaLoad

PROFILE = EngineProfile.load()


def sticky_table() -> Ledger:
    return Ledger(Sticky(), PROFILE)


def place(table: Ledger, session: str, blocks: int) -> str:
    """Bind a one-shot job of `blocks` KV blocks; where it went."""
    work = Work(prompt_tokens=1, answer_tokens=1, kv_blocks=blocks)
    return table.place(work, session=session).replica


def update(table: Ledger, live: set[str], loads: list[ReplicaLoad]) -> None:
    """A poll: `live` routed to, `loads` the reports that came."""
    table.take_reports(live, [load.report() for load in loads])


def load(replica: str, reserved: int, capacity: int = 100, **kw) -> ReplicaLoad:
    return ReplicaLoad(
        replica=replica, capacity_blocks=capacity, reserved_blocks=reserved, sessions=0, **kw
    )


def test_new_sessions_go_to_the_replica_with_most_room() -> None:
    table = sticky_table()
    update(table, {"a", "b"}, [load("a", 70), load("b", 20)])
    assert place(table, "s1", 30) == "b"  # room: a 30, b 80
    assert place(table, "s2", 30) == "b"  # room: a 30, b 50
    # Each placement counts at once, so a burst does not pile onto the first "emptiest".
    assert place(table, "s3", 30) == "a"  # room: a 30, b 20
    assert table.loads["b"].reserved_blocks == 80
    assert [table.replica_of(s) for s in ("s1", "s2", "s3")] == ["b", "b", "a"]


def test_a_replica_that_cannot_hold_the_session_is_skipped() -> None:
    table = sticky_table()
    update(table, {"a", "b"}, [load("a", 10, capacity=40), load("b", 60)])
    # a has the lower reservation but only 30 blocks of room; b has 40.
    assert place(table, "big", 35) == "b"
    with pytest.raises(NoRoom) as info:
        place(table, "huge", 80)
    assert info.value.replicas == 2


def test_adding_replicas_never_moves_a_session() -> None:
    table = sticky_table()
    update(table, {"a"}, [load("a", 0)])
    place(table, "s", 10)
    update(table, {"a", "b", "c"}, [load("a", 90), load("b", 0), load("c", 0)])
    assert table.replica_of("s") == "a" and table.is_live("a")


def test_draining_or_unhealthy_replicas_take_no_new_session() -> None:
    table = sticky_table()
    update(
        table,
        {"a", "b", "c"},
        [load("a", 0, draining=True), load("b", 0, healthy=False), load("c", 90)],
    )
    assert place(table, "s", 5) == "c"
    assert not table.is_live("b")


def test_a_missed_poll_keeps_the_last_load_and_a_gone_replica_is_dropped() -> None:
    table = sticky_table()
    update(table, {"a", "b"}, [load("a", 5), load("b", 7)])
    update(table, {"a", "b"}, [load("a", 6)])  # b was busy: no report this time
    assert table.loads["b"].reserved_blocks == 7 and table.is_live("b")
    update(table, {"a"}, [load("a", 6)])  # b left the deployment
    assert not table.is_live("b") and set(table.loads) == {"a"}


def test_a_replica_without_a_free_session_slot_takes_no_new_session() -> None:
    table = sticky_table()
    full = ReplicaLoad(
        replica="a", capacity_blocks=100, reserved_blocks=0, sessions=4, max_sessions=4
    )
    update(table, {"a", "b"}, [full, load("b", 90)])
    assert place(table, "s", 5) == "b"
    with pytest.raises(NoRoom):
        place(table, "t", 50)


def test_a_replica_routed_to_but_not_yet_reported_still_holds_its_sessions() -> None:
    """Router B polls a replica that router A bound a session to; until B's first load
    report arrives the session must not be moved off it."""
    table = sticky_table()
    update(table, {"a", "b"}, [load("a", 0)])  # b's poll timed out
    assert table.is_live("b") and table.is_live("a")
    update(table, {"a"}, [load("a", 0)])  # b left Serve's routing set
    assert not table.is_live("b")
    update(table, {"a", "b"}, [load("a", 0), load("b", 0, healthy=False)])
    assert not table.is_live("b")  # reported, and not healthy
    # Placement still needs a report: an unreported replica takes no new session.
    fresh = sticky_table()
    update(fresh, {"a", "b"}, [load("a", 90)])
    assert place(fresh, "s", 10) == "a"


def test_equal_room_goes_to_fewer_sessions_and_each_placement_takes_a_slot() -> None:
    table = sticky_table()
    update(
        table,
        {"a", "b"},
        [
            ReplicaLoad(replica="a", capacity_blocks=100, reserved_blocks=0, sessions=1),
            ReplicaLoad(replica="b", capacity_blocks=100, reserved_blocks=0, sessions=0),
        ],
    )
    # Same room: the replica with fewer sessions.
    assert place(table, "s1", 0) == "b"
    assert table.loads["b"].sessions == 1
    # Now tied on room and sessions: the name breaks the tie ("b" > "a").
    assert place(table, "s2", 0) == "b"
    assert (table.loads["a"].sessions, table.loads["b"].sessions) == (1, 2)
    assert place(table, "s3", 0) == "a"


def test_work_seen_ending_stops_counting_before_the_next_report() -> None:
    table = Ledger(ExpectedWait(PROFILE), PROFILE)
    update(table, {"a", "b"}, [load("a", 0), load("b", 0)])
    work = Work(prompt_tokens=2000, answer_tokens=16, kv_blocks=10)
    first = table.place(work, session="j1")
    assert first.replica == "a" and table.loads["a"].backlog_s == first.seconds > 0
    assert table.place(work, session="j2").replica == "b"  # a burst spreads: a is booked
    table.done(first)
    assert (table.loads["a"].backlog_s, table.loads["a"].running) == (0.0, 0)
    # Reported since it was booked: the report counted what was left of it then, no more.
    second = table.place(work, session="j3")
    assert second.replica == "a"
    update(table, {"a", "b"}, [load("a", 10, backlog_s=5.0, running=1), load("b", 10)])
    table.done(second)
    assert 5.0 - second.seconds <= table.loads["a"].backlog_s < 5.0
    assert table.loads["a"].running == 0
