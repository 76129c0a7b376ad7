"""`wim sim`'s figures and table (`sim/report.py`), each figure and cell worked out by hand."""

from __future__ import annotations

import pytest

from wim_service.sim.report import figures, summarise, table
from wim_service.sim.result import Outcome, RunResult


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


def _result(ttfts: list[float], requests: int, too_large: int) -> RunResult:
    result = RunResult("sticky", 1, requests, too_large=too_large)
    result.outcomes = [Outcome(i, 0.0, ttft, ttft + 1.0, 10, 0, 0) for i, ttft in enumerate(ttfts)]
    return result


def test_p95_of_all_counts_an_unanswered_request_as_never_answered() -> None:
    answered = [float(t) for t in range(1, 41)]  # 40 answers, 1-40 s
    # Every request that fits answered: the p95 of the answers, 38 + (39 - 38) x 0.05.
    assert summarise(_result(answered, 42, too_large=2))["ttft_p95_all_s"] == 38.05
    # One of 41 unanswered: rank 38 of 0-40 is the 39th answer, 39 s; the answers' own p95 stays.
    row = summarise(_result(answered, 43, too_large=2))
    assert (row["ttft_p95_all_s"], row["ttft_p95_s"]) == (39.0, 38.05)
    # 20 answers and one unanswered: rank 19 of 0-20 falls on the 20th answer, beside it.
    assert summarise(_result(answered[:20], 21, too_large=0))["ttft_p95_all_s"] == 20.0
    # Three of 43 unanswered: the p95 falls among them.
    assert summarise(_result(answered, 45, too_large=2))["ttft_p95_all_s"] is None
