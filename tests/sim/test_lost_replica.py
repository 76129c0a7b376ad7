"""A replica lost mid-replay (`simulate(..., losses=...)`), as the live router sees one die:
the work on it fails over, its sessions are read again elsewhere (restored, as a rebuild is),
and a plain request on it fails. The router and the simulator losing the same replica in one
scripted scenario: `tests/placement/test_one_scenario.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fakes.profile import PROFILE
from tests.sim.test_sim import doc_row, document_trace
from wim_service.cli import main
from wim_service.placement.profile import RestoreCost
from wim_service.sim.replay import simulate
from wim_service.sim.settings import SimSettings

READ_S = PROFILE.prefill.seconds(3000)  # a 3,000-token document's first read


@pytest.mark.parametrize("policy", ["round_robin", "sticky", "expected_wait"])
def test_a_query_running_on_a_lost_replica_is_answered_on_another(
    policy: str, tmp_path: Path
) -> None:
    trace = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (first,) = simulate(trace, policy, 2, PROFILE).outcomes
    # Lost while the query runs there: placed again on the other replica (its session read
    # again there if the lost one held its only copy), and answered later.
    losses = [(first.first_token_s - 0.1, first.replica)]
    lost = simulate(trace, policy, 2, PROFILE, losses=losses)
    (answered,) = lost.outcomes
    assert answered.replica != first.replica and lost.refused == 0
    assert answered.first_token_s > first.first_token_s


def test_a_session_read_on_a_lost_replica_is_read_again_on_another(tmp_path: Path) -> None:
    trace = document_trace([doc_row(0, "a", wim=True)], tmp_path)
    (first,) = simulate(trace, "sticky", 2, PROFILE).outcomes
    # Lost halfway through the session's read: read again from the start on the other.
    lost = simulate(trace, "sticky", 2, PROFILE, losses=[(READ_S / 2, first.replica)])
    (answered,) = lost.outcomes
    assert answered.replica != first.replica and lost.refused == 0
    assert answered.first_token_s == pytest.approx(first.first_token_s + READ_S / 2)


def test_a_session_whose_every_holder_was_lost_is_restored_at_its_next_query(
    tmp_path: Path,
) -> None:
    profile = PROFILE.model_copy(update={"restore": RestoreCost(fixed_s=0.05, per_token_s=6e-5)})
    restore = profile.read_seconds(3000, saved=True)
    assert restore < READ_S
    rows = [doc_row(0, "a", wim=True), doc_row(100, "a", wim=True)]
    trace = document_trace(rows, tmp_path)
    first, later = sorted(simulate(trace, "sticky", 2, profile).outcomes, key=lambda o: o.index)
    lost = simulate(trace, "sticky", 2, profile, losses=[(50.0, first.replica)])
    again = next(o for o in lost.outcomes if o.index == 1)
    # Read again on the other replica before its query: restored, not prefilled.
    assert again.replica != first.replica and lost.copies_opened == 2
    assert again.first_token_s == pytest.approx(later.first_token_s + restore)


@pytest.mark.parametrize("retries", [0, 1])
def test_a_plain_request_on_a_lost_replica_fails_as_the_service_fails_it(
    retries: int, tmp_path: Path
) -> None:
    trace = document_trace([doc_row(0, "a", wim=False)], tmp_path)
    (alone,) = simulate(trace, "round_robin", 2, PROFILE).outcomes
    settings = SimSettings(retries=retries)
    lost = simulate(trace, "round_robin", 2, PROFILE, settings, [(0.5, alone.replica)])
    # Not failed over (503, Retry-After): sent again only if its client retries.
    assert (lost.refused, lost.retried, len(lost.outcomes)) == (1 - retries, retries, retries)
    assert all(o.replica != alone.replica for o in lost.outcomes)


def test_wim_sim_loses_a_replica_when_asked(tmp_path: Path) -> None:
    rows = [doc_row(t, "a", wim=False) for t in (0, 0.2, 0.4, 0.6)]
    trace = tmp_path / "plain.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "rows.json"
    argv = ["sim", "--trace", str(trace), "--replicas", "2", "--policies", "round_robin"]
    assert main([*argv, "--json-out", str(out), "--lose-replica", "0.1:0"]) == 0
    (row,) = json.loads(out.read_text())
    # The first request ran on replica 0 when it was lost; the others ran on replica 1.
    assert (row["completed"], row["refused"]) == (3, 1)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("0.1", "--lose-replica takes T:INDEX, like 300:0, not '0.1'"),
        ("nan:0", "--lose-replica T must be within 0-1e+09, not nan"),
        ("5:2", "--lose-replica INDEX must be within 0-1, not 2"),
    ],
)
def test_wim_sim_refuses_a_loss_it_cannot_replay(
    loss: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "plain.jsonl"
    trace.write_text(json.dumps(doc_row(0, "a", wim=False)) + "\n")
    argv = ["sim", "--trace", str(trace), "--replicas", "2,4", "--lose-replica", loss]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_session_lost_while_it_is_first_read_is_read_afresh_again_later(
    tmp_path: Path,
) -> None:
    """Lost during its first read, the session is read afresh on the other replica; once
    that copy retires, its next read is a first read again, not a restore."""
    profile = PROFILE.model_copy(update={"restore": RestoreCost(fixed_s=0.05, per_token_s=6e-5)})
    rows = [doc_row(0, "a", wim=True), doc_row(1000, "a", wim=True)]
    trace = document_trace(rows, tmp_path)
    settings = SimSettings(copy_idle_s=100.0)
    first, later = sorted(
        simulate(trace, "sticky", 2, profile, settings).outcomes, key=lambda o: o.index
    )
    lost = simulate(trace, "sticky", 2, profile, settings, [(READ_S / 2, first.replica)])
    again = next(o for o in lost.outcomes if o.index == 1)
    assert again.first_token_s == pytest.approx(later.first_token_s)
