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


def test_a_burst_on_a_hot_document_spreads_over_every_replica_with_room(tmp_path: Path) -> None:
    # The document is read once; then 12 queries of it arrive at once on 12 replicas. Each
    # is quicker on a replica of its own (a restore, then the query) than behind another on a
    # holder, so each opens a copy: none waits for another's prefill.
    replicas = 12
    rows = [doc_row(0, "a", wim=True)] + [doc_row(60, "a", wim=True) for _ in range(replicas)]
    trace = document_trace(rows, tmp_path)
    result = simulate(trace, "expected_wait", replicas, RESTORING, SimSettings())
    burst = [o for o in result.outcomes if o.arrival_s == 60]
    assert result.refused == 0 and len(burst) == replicas
    assert len({o.replica for o in burst}) == replicas
    alone = min(o.first_token_s for o in burst) - 60
    assert max(o.first_token_s for o in burst) - 60 < 1.5 * alone
