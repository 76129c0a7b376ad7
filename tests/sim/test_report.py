"""`wim sim`'s figures and table (`sim/report.py`), each figure and cell worked out by hand."""

from __future__ import annotations

import pytest

from wim_service.sim.report import figures, table


def test_each_figure_from_the_completed_requests() -> None:
    ttft = [1.0, 2.0, 3.0, 4.0, 10.0]
    e2e = [2.0, 3.0, 4.0, 5.0, 11.0]
    row = figures(ttft, e2e, prompt_tokens=3, cached_tokens=1, span_s=0.5)
    assert row["completed"] == 5
    assert row["ttft_mean_s"] == 4.0
    assert row["ttft_p50_s"] == 3.0
    assert row["ttft_p95_s"] == pytest.approx(8.8)  # 4 + (10 - 4) x 0.8
    assert row["ttft_p99_s"] == pytest.approx(9.76)
    assert row["e2e_mean_s"] == 5.0
    assert row["requests_per_s"] == 10.0  # five in half a second
    assert row["prefix_reuse"] == 0.3333  # to four digits: the table shows a tenth of a percent


def test_figures_are_rounded_to_the_millisecond() -> None:
    row = figures([1.23456], [2.34567], prompt_tokens=1, cached_tokens=0, span_s=3.0)
    assert (row["ttft_mean_s"], row["ttft_p95_s"], row["e2e_mean_s"]) == (1.235, 1.235, 2.346)
    assert row["requests_per_s"] == 0.333


def test_the_table_puts_names_left_and_numbers_right() -> None:
    rows = [
        {"policy": "expected_wait", "replicas": 16, "ttft_p95_s": 0.5},
        {"policy": "rr", "replicas": 2, "ttft_p95_s": 12.25},
    ]
    assert table(rows, ["policy", "replicas", "ttft_p95_s"]).splitlines() == [
        "| policy        | replicas | TTFT p95 s |",
        "|---------------|----------|------------|",
        "| expected_wait |       16 |       0.50 |",
        "| rr            |        2 |      12.25 |",
    ]
