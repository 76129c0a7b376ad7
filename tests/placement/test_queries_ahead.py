"""A query of a document starts on a holder only after the queries of that document ahead of
it on the same copy (they take turns in its KV): expected wait counts them, and the router and
`wim sim` both give it their book's count per holder (`CopyBook.running`)."""

from __future__ import annotations

from pathlib import Path

from tests.fakes.fake_service import ScriptedReplica
from tests.serving.routing.test_router_copies import ask, opened, router_over
from wim_service.placement.ledger import Ledger, LoadReport
from wim_service.placement.policy import ExpectedWait, job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.shapes import document_query
from wim_service.placement.state import ReplicaState
from wim_service.sim.replay import Replay
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import read_trace

PROFILE = EngineProfile.load()
QUERY = document_query(
    "doc", 4096, 200, query_tokens=64, answer_tokens=128, margins=8, margin_tokens=48
)


def fleet() -> list[ReplicaState]:
    """r0 holds the document, r1 has room and no copy; the same work queued on both."""
    return [
        ReplicaState(
            "r0", free_blocks=500, free_sessions=3, backlog_s=5.0, documents=frozenset({"doc"})
        ),
        ReplicaState("r1", free_blocks=5000, free_sessions=4, backlog_s=5.0),
    ]


def test_a_holder_with_queries_of_the_document_ahead_waits_for_their_turns() -> None:
    policy = ExpectedWait(PROFILE)
    alone = policy.place(QUERY, fleet())
    assert (alone.replica, alone.open_copy) == ("r0", False)
    holder, other = fleet()
    holder.queries_ahead = 4
    # Four whole queries in turn before it: longer than the queued work, and than a copy.
    turns = 4 * job_s(PROFILE, QUERY, holder)
    assert policy.start_s(QUERY, holder, copy=False) > turns > holder.backlog_s
    busy = policy.place(QUERY, [holder, other])
    assert (busy.replica, busy.open_copy) == ("r1", True)


def test_the_ledger_gives_each_holder_its_queries_ahead() -> None:
    ledger = Ledger(ExpectedWait(PROFILE), PROFILE, clock=lambda: 0.0)
    reports = [LoadReport(r, capacity_blocks=5000, reserved_blocks=0, sessions=1) for r in "ab"]
    ledger.take_reports("ab", reports)
    states = ledger.states(QUERY, holders=["a"], ahead={"a": 3})
    assert [s.queries_ahead for s in states] == [3, 0]
    alone = ledger.place(QUERY, holders=["a"])
    assert alone.replica == "a"
    ledger.cancel(alone)
    placed = ledger.place(QUERY, holders=["a"], ahead={"a": 4})
    assert (placed.replica, placed.placement.open_copy) == ("b", True)


def test_wim_sim_weighs_a_holder_by_the_queries_its_book_has_there(tmp_path: Path) -> None:
    trace = tmp_path / "one.jsonl"
    trace.write_text(
        '{"timestamp_s": 0, "session_id": "s", "document_id": "doc", "document_tokens": 4096,'
        ' "query_tokens": 64, "answer_tokens": 128, "wim": true}\n'
    )
    replay = Replay(read_trace(trace), "expected_wait", 2, PROFILE, SimSettings())
    holder = replay.engines[0]
    holder.book(0, document="doc", copy_blocks=200)  # it holds the document
    assert replay._booked(QUERY, 0.0).replica == holder.name
    for _ in range(4):  # queries placed there and not ended: the next one waits their turns
        replay.copies.begin("doc", holder.name)
    booked = replay._booked(QUERY, 0.0)
    assert (booked.replica, booked.placement.open_copy) == (replay.engines[1].name, True)


async def test_the_router_weighs_a_holder_by_its_queries_running_there() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, max_copies=2)
    document_id = await opened(router)
    assert await ask(router, document_id) == "a"  # alone: where the document is
    for _ in range(4):  # this router's queries of the document still on a
        router.dispatcher.copies.begin(document_id, "a", primary=True)
    assert await ask(router, document_id) == "b"
    session = await router.documents.get(document_id)
    assert session is not None and session.copies == ("b",)
