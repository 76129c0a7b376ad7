"""Expected wait where a hot document would saturate its holders: its queries spread over
every replica with room (a copy restored there), instead of queueing at a few holders while
the others idle. No engine, no network.
"""

from __future__ import annotations

from pathlib import Path

from tests.sim.test_sim import PROFILE, doc_row, document_trace
from wim_service.placement.profile import RestoreCost
from wim_service.sim.replay import simulate
from wim_service.sim.settings import SimSettings

# Restoring a saved document costs a small part of reading it (as the shipped profile's).
RESTORING = PROFILE.model_copy(update={"restore": RestoreCost(fixed_s=0.05, per_token_s=4e-5)})


def test_a_hot_documents_queries_spread_over_every_replica_with_room(tmp_path: Path) -> None:
    # The document is read once; then 12 queries of it arrive 0.2 s apart on 12 replicas,
    # each before the ones ahead of it have ended. Most are quicker on a replica of their own
    # (a restore, then the query) than behind another on a holder, so they open copies, each
    # once the one before is read (the router reads one copy of a document at a time): none
    # waits long for another's prefill.
    replicas = 12
    rows = [doc_row(0, "a", wim=True)]
    rows += [doc_row(60 + 0.2 * i, "a", wim=True) for i in range(replicas)]
    trace = document_trace(rows, tmp_path)
    result = simulate(trace, "expected_wait", replicas, RESTORING, SimSettings())
    burst = [o for o in result.outcomes if o.arrival_s >= 60]
    assert result.refused == 0 and len(burst) == replicas
    assert len({o.replica for o in burst}) > replicas // 2
    waits = [o.first_token_s - o.arrival_s for o in burst]
    assert max(waits) < 1.5 * min(waits)


def test_a_burst_at_one_instant_opens_one_copy_of_its_document(tmp_path: Path) -> None:
    # As the router: while a copy of a document is read, its other queries open none and
    # wait their turns on the session's primary.
    rows = [doc_row(0, "a", wim=True)] + [doc_row(60, "a", wim=True) for _ in range(6)]
    trace = document_trace(rows, tmp_path)
    result = simulate(trace, "expected_wait", 6, RESTORING, SimSettings())
    assert result.refused == 0 and len(result.outcomes) == 7
    assert result.copies_opened == 2  # the session's read, and one copy


def test_max_copies_one_keeps_a_hot_document_on_its_first_holder(tmp_path: Path) -> None:
    rows = [doc_row(0, "a", wim=True)] + [doc_row(60 + 0.2 * i, "a", wim=True) for i in range(6)]
    trace = document_trace(rows, tmp_path)
    result = simulate(trace, "expected_wait", 6, RESTORING, SimSettings(max_copies=1))
    assert result.refused == 0 and len(result.outcomes) == 7
    assert result.copies_opened == 1  # the session's read alone
    assert {o.replica for o in result.outcomes} == {result.outcomes[0].replica}


def test_goodput_is_per_second_from_the_first_arrival_to_the_last(tmp_path: Path) -> None:
    rows = [doc_row(5, "a", wim=True), doc_row(9, "a", wim=False), doc_row(12, "a", wim=True)]
    result = simulate(document_trace(rows, tmp_path), "sticky", 1, PROFILE, SimSettings())
    assert (result.requests, result.offered_s) == (3, 7.0)
