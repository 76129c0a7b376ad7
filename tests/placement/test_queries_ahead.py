"""A query of a document starts on a holder only after the queries of that document ahead of
it on the same copy (they take turns in its KV): the ledger gives each holder's count to the
policy (`ReplicaState.queries_ahead`), from the router's or `wim sim`'s book of copies."""

from __future__ import annotations

from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import ExpectedWait
from wim_service.placement.profile import EngineProfile
from wim_service.placement.shapes import document_query

PROFILE = EngineProfile.load()
QUERY = document_query(
    "doc", 4096, 200, query_tokens=64, answer_tokens=128, margins=8, margin_tokens=48
)


def test_the_ledger_gives_each_holder_its_queries_ahead() -> None:
    ledger = Ledger(ExpectedWait(PROFILE), PROFILE, clock=lambda: 0.0)
    reports = [LoadReport(r, capacity_blocks=5000, reserved_blocks=0, sessions=1) for r in "ab"]
    ledger.take_reports("ab", reports)
    states = ledger.states(QUERY, holders=["a"], ahead={"a": 3})
    assert [(s.replica, s.queries_ahead) for s in states] == [("a", 3), ("b", 0)]
    assert [s.queries_ahead for s in ledger.states(QUERY, holders=["a"])] == [0, 0]
