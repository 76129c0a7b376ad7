"""A document query's placement among its holders (`placement.copies.QuerySteps`), the steps
the router's `DocumentCopies.holder` and `wim sim`'s `Replay._holder` both take: placed, placed
again on fresh loads if it opens a copy (by a policy that weighs loads), the copy checked."""

from __future__ import annotations

from tests.placement.test_ledger import report
from wim_service.placement.copies import QuerySteps
from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import ExpectedWait, RoundRobin
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import Work

PROFILE = EngineProfile.load()
# A query of a 2,900-token document: a copy of it reads 6 KV blocks, the query takes 2.
QUERY = Work(3000, 16, kv_blocks=2, document="doc", document_tokens=2900, document_blocks=6)


def fleet(*reports: LoadReport, weighs: bool = True) -> Ledger:
    policy = ExpectedWait(PROFILE) if weighs else RoundRobin()
    ledger = Ledger(policy, PROFILE, clock=lambda: 0.0)
    ledger.take_reports([r.replica for r in reports], reports)
    return ledger


def test_a_query_on_an_idle_holder_is_placed_once_and_booked_there() -> None:
    ledger = fleet(report("a"), report("b"))
    steps = QuerySteps(ledger, QUERY)
    assert not steps.place(["a"])  # no copy: no loads asked again
    booking = steps.settle(["a"], max_copies=8, opening=False)
    assert booking is not None and booking.replica == "a" and not booking.placement.open_copy


def test_a_copy_is_placed_again_on_fresh_loads_once_and_opens_if_it_may() -> None:
    ledger = fleet(report("a", backlog_s=600.0, running=4), report("b"))
    steps = QuerySteps(ledger, QUERY)
    assert steps.place(["a"])  # a copy on b, on old loads: cancelled, loads asked again
    assert steps.booking is None and ledger.loads["b"].running == 0
    ledger.take_reports(["a", "b"], [report("a", backlog_s=600.0, running=4), report("b")])
    assert not steps.place(["a"])  # still a copy: placed, not asked again
    booking = steps.settle(["a"], max_copies=8, opening=False)
    assert booking is not None and booking.replica == "b" and booking.placement.open_copy
    assert ledger.loads["b"].running == 1


def test_a_copy_that_may_not_open_runs_on_the_primary_unbooked() -> None:
    for max_copies, opening in ((1, False), (8, True)):  # holders full; a read under way
        ledger = fleet(report("a", backlog_s=600.0, running=4), report("b"))
        steps = QuerySteps(ledger, QUERY)
        while steps.place(["a"]):
            pass
        assert steps.settle(["a"], max_copies, opening) is None
        assert ledger.loads["b"].running == 0  # its booking cancelled


def test_a_policy_that_weighs_no_loads_asks_none_and_holders_lost_meanwhile_leave_none() -> None:
    ledger = fleet(report("a"), report("b"), weighs=False)
    steps = QuerySteps(ledger, QUERY)
    assert not steps.place(["a"]) and steps.booking is not None  # round robin's turn: no ask
    ledger = fleet(report("a", backlog_s=600.0, running=4), report("b"))
    steps = QuerySteps(ledger, QUERY)
    assert steps.place(["a"])
    assert not steps.place([])  # its holder was lost while the loads were asked
    assert steps.settle([], max_copies=8, opening=False) is None


def test_no_room_anywhere_leaves_the_query_to_its_primary_without_asking() -> None:
    ledger = fleet(report("a", reserved=100), report("b", reserved=100))  # KV all reserved
    steps = QuerySteps(ledger, QUERY)
    assert not steps.place(["a"]) and steps.settle(["a"], 8, opening=False) is None
