"""A multi-node cluster that is not whole in time fails with the tails of its head's logs
(tests/harness/multinode.py `Cluster.wait_whole`): the evidence of a failed run, kept in its
failure message."""

from __future__ import annotations

from pathlib import Path

from tests.harness.multinode import LOGS_SHOWN_ON_FAILURE, head_log_tails


def test_the_tails_of_the_heads_logs_and_those_missing(tmp_path: Path) -> None:
    logs = tmp_path / "session_latest" / "logs"
    logs.mkdir(parents=True)
    gcs, dashboard = LOGS_SHOWN_ON_FAILURE
    (logs / gcs).write_text("\n".join(f"gcs line {n}" for n in range(100)))
    tails = head_log_tails(tmp_path)
    assert "gcs line 99" in tails and "gcs line 60" in tails
    assert "gcs line 59" not in tails  # its last 40 lines only
    assert tails.endswith(f"{logs / dashboard}, last 40 lines:\n(none)")
