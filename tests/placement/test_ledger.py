"""The ledger (`placement/ledger.py`): reports kept as taken, bookings apart from them and
numbered, so that a report covers exactly the bookings made before it was asked."""

from __future__ import annotations

import dataclasses

import pytest

from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import ExpectedWait, Sticky
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Work

PROFILE = EngineProfile.load()
JOB = Work(prompt_tokens=2000, answer_tokens=16, kv_blocks=10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(replica: str, reserved: int = 0, **kw: float) -> LoadReport:
    return LoadReport(replica, capacity_blocks=100, reserved_blocks=reserved, sessions=0, **kw)  # type: ignore[arg-type]


def ledger(*replicas: str, policy: str = "wim") -> tuple[Ledger, Clock]:
    clock = Clock()
    book = Ledger(ExpectedWait(PROFILE) if policy == "wim" else Sticky(), PROFILE, clock=clock)
    book.take_reports(replicas, [report(r) for r in replicas])
    return book, clock


def test_a_report_is_never_changed_by_what_is_booked_on_it() -> None:
    book, _ = ledger("a")
    taken = report("a")
    book.take_reports({"a"}, [taken])
    booking = book.place(JOB, session="j")
    assert taken == report("a")  # the report as it came
    with pytest.raises(dataclasses.FrozenInstanceError):
        taken.backlog_s = 1.0  # type: ignore[misc]
    load = book.loads["a"]
    assert (load.reserved_blocks, load.sessions, load.running) == (10, 1, 1)
    assert load.backlog_s == booking.seconds > 0 and book.replica_of("j") == "a"


def test_a_burst_spreads_and_work_seen_ending_stops_counting() -> None:
    book, _ = ledger("a", "b")
    first = book.place(JOB)
    assert (first.replica, book.place(JOB).replica) == ("a", "b")
    book.done(first)
    load = book.loads["a"]
    # Its time and running job end; its KV stays until a report says it is free.
    assert (load.backlog_s, load.running, load.reserved_blocks) == (0.0, 0, 10)


def test_a_report_asked_before_a_booking_does_not_drop_it() -> None:
    """The report was asked, then the job was booked, then the report came: it cannot have
    counted the job, so the job still counts on top of it."""
    book, _ = ledger("a", "b")
    asked = book.mark()
    before = book.place(JOB)
    book.take_reports({"a", "b"}, [report("a"), report("b")], covers={"a": asked, "b": asked})
    assert book.loads["a"].backlog_s == before.seconds and book.loads["a"].running == 1
    # A report asked after it covers it: the replica's own figures replace the booking.
    book.take_reports({"a", "b"}, [report("a", 10, backlog_s=3.0, running=1), report("b")])
    assert (book.loads["a"].backlog_s, book.loads["a"].reserved_blocks) == (3.0, 10)
    book.cancel(before)  # a covered booking was counted by the replica: nothing to undo
    assert book.loads["a"].reserved_blocks == 10


def test_work_ending_after_a_report_counted_it_comes_off_that_report() -> None:
    book, clock = ledger("a", "b")
    booked = book.place(JOB)
    clock.now += 1.0
    book.take_reports({"a", "b"}, [report("a", 10, backlog_s=5.0, running=1), report("b")])
    book.done(booked)
    # The report counted what was left of it then: its cost less the second it had run.
    assert book.loads["a"].backlog_s == pytest.approx(5.0 - (booked.seconds - 1.0))
    assert book.loads["a"].running == 0
    book.take_reports({"a", "b"}, [report("a", 10, backlog_s=2.0), report("b")])
    assert book.loads["a"].backlog_s == 2.0  # the next report knows it ended


def test_a_cancelled_booking_leaves_nothing_behind() -> None:
    book, _ = ledger("a", policy="sticky")
    booking = book.place(Work(prompt_tokens=1, answer_tokens=1, kv_blocks=60))
    book.cancel(booking)
    assert book.loads["a"] == report("a")


def test_a_lost_replica_stays_lost_until_a_report_asked_after_the_loss() -> None:
    book, _ = ledger("a", "b")
    asked = book.mark()
    book.lose("a")
    assert not book.is_live("a") and {s.replica for s in book.states(JOB)} == {"b"}
    book.take_reports({"a", "b"}, [report("a"), report("b")], covers={"a": asked, "b": asked})
    assert not book.is_live("a")  # that report was asked before the loss
    book.take_reports({"a", "b"}, [report("a"), report("b")])
    assert book.is_live("a")


def test_an_unreported_replica_is_live_but_takes_no_work() -> None:
    book, _ = ledger("a")
    book.take_reports({"a", "b"}, [])
    assert book.is_live("b") and "b" not in book.loads
    book.take_reports({"a"}, [])  # b left the routing set
    assert not book.is_live("b")
    book.take_reports(set(), [])
    with pytest.raises(NoRoom):
        book.place(JOB)


def test_a_replica_lost_for_silence_is_back_with_any_report_it_answers() -> None:
    book, _ = ledger("a", "b")
    asked = book.mark()
    book.lose("a", silent=True)
    assert not book.is_live("a")
    book.take_reports({"a", "b"}, [report("a")], covers={"a": asked})
    assert book.is_live("a")  # it answered the call it was silent on
