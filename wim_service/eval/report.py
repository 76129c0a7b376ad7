"""Tables (markdown, JSON) and a plot: each method's score with a 95% bootstrap interval, its
paired difference from plain long context on the same tasks, invented values and cost."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wim_service.eval.runner import RunRecord
from wim_service.eval.tasks import TaskKind

METRIC = {
    TaskKind.NEEDLE: "exact match",
    TaskKind.MULTI_HOP: "exact match",
    TaskKind.BABI: "exact match",
    TaskKind.AGGREGATION: "F1",
}
BASELINE = "plain"
RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% percentile-bootstrap interval (resampling tasks)."""

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        return f"{self.mean:.2f} [{self.low:.2f}, {self.high:.2f}]"

    def signed(self) -> str:
        if self.n == 0:
            return "-"
        return f"{self.mean:+.2f} [{self.low:+.2f}, {self.high:+.2f}]"


def bootstrap(values: Iterable[float], *, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """Mean of `values` with the 2.5th and 97.5th percentiles of `resamples` resampled means."""
    import numpy as np

    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(data.mean()), float(low), float(high), int(data.size))


@dataclass(frozen=True)
class MethodSummary:
    """A method's scores per task kind and over all tasks, invented values, and mean cost."""

    method: str
    by_kind: dict[str, Interval]
    mean_score: Interval
    # Share of answers holding a number or name that is not in the document, and their count.
    hallucination_rate: float
    hallucinated_values: int
    prompt_tokens_computed: float
    generated_tokens: float
    wall_s: float
    errors: int


@dataclass(frozen=True)
class PairedComparison:
    """method minus baseline on the same tasks: mean difference, its interval, wins/ties/losses."""

    method: str
    baseline: str
    by_kind: dict[str, Interval]
    mean_difference: Interval
    wins: int
    ties: int
    losses: int


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def _ordered(records: list[RunRecord]) -> tuple[list[str], list[TaskKind], list[int]]:
    methods = list(dict.fromkeys(r.method for r in records))
    kinds = [k for k in TaskKind if any(r.kind is k for r in records)]
    lengths = sorted({r.length for r in records})
    return methods, kinds, lengths


def score_grid(records: list[RunRecord]) -> dict[str, dict[str, dict[int, float]]]:
    """{kind: {method: {length: mean score}}}."""
    methods, kinds, lengths = _ordered(records)
    return {
        kind.value: {
            m: {
                n: _mean(r.score for r in records if (r.kind, r.method, r.length) == (kind, m, n))
                for n in lengths
            }
            for m in methods
        }
        for kind in kinds
    }


def summarize(records: list[RunRecord]) -> list[MethodSummary]:
    methods, kinds, _ = _ordered(records)
    summaries = []
    for method in methods:
        mine = [r for r in records if r.method == method]
        summaries.append(
            MethodSummary(
                method=method,
                by_kind={k.value: bootstrap(r.score for r in mine if r.kind is k) for k in kinds},
                mean_score=bootstrap(r.score for r in mine),
                hallucination_rate=_mean(bool(r.hallucinated) for r in mine),
                hallucinated_values=sum(len(r.hallucinated) for r in mine),
                prompt_tokens_computed=_mean(r.result.prompt_tokens_computed for r in mine),
                generated_tokens=_mean(r.result.generated_tokens for r in mine),
                wall_s=_mean(r.result.wall_s for r in mine),
                errors=sum(r.result.error is not None for r in mine),
            )
        )
    return summaries


def compare(records: list[RunRecord], baseline: str = BASELINE) -> list[PairedComparison]:
    """Every other method against `baseline`, task by task (tasks both answered)."""
    methods, kinds, _ = _ordered(records)
    base = {r.task_id: r for r in records if r.method == baseline}
    comparisons = []
    for method in methods:
        if method == baseline:
            continue
        pairs = [(r, base[r.task_id]) for r in records if r.method == method and r.task_id in base]
        diffs = [a.score - b.score for a, b in pairs]
        comparisons.append(
            PairedComparison(
                method=method,
                baseline=baseline,
                by_kind={
                    k.value: bootstrap(a.score - b.score for a, b in pairs if a.kind is k)
                    for k in kinds
                },
                mean_difference=bootstrap(diffs),
                wins=sum(d > 0 for d in diffs),
                ties=sum(d == 0 for d in diffs),
                losses=sum(d < 0 for d in diffs),
            )
        )
    return comparisons


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _summary_table(records: list[RunRecord], kinds: list[TaskKind]) -> list[str]:
    """Each method's scores per kind and overall, invented values and cost."""
    lines = [
        _row(
            ["method"]
            + [f"{k.value} ({METRIC[k]})" for k in kinds]
            + ["mean", "invented", "prompt tokens computed", "generated tokens", "wall s"]
            + ["errors"]
        ),
        _row(["---"] * (len(kinds) + 7)),
    ]
    for s in summarize(records):
        lines.append(
            _row(
                [s.method]
                + [str(s.by_kind[k.value]) for k in kinds]
                + [
                    str(s.mean_score),
                    f"{s.hallucination_rate:.2f}",
                    f"{s.prompt_tokens_computed:.0f}",
                    f"{s.generated_tokens:.0f}",
                    f"{s.wall_s:.1f}",
                    s.errors,
                ]
            )
        )
    return lines


def _paired_table(records: list[RunRecord], kinds: list[TaskKind]) -> list[str]:
    """Every method's paired difference from the baseline; nothing without a baseline."""
    comparisons = compare(records)
    if not comparisons:
        return []
    lines = [
        "",
        f"## Paired difference from {BASELINE} (same tasks; interval excluding 0 = a real "
        "difference)",
        "",
        _row(["method", *(k.value for k in kinds), "all", "wins / ties / losses"]),
        _row(["---"] * (len(kinds) + 3)),
    ]
    for c in comparisons:
        lines.append(
            _row(
                [c.method]
                + [c.by_kind[k.value].signed() for k in kinds]
                + [c.mean_difference.signed(), f"{c.wins} / {c.ties} / {c.losses}"]
            )
        )
    return lines


def _by_length_tables(records: list[RunRecord]) -> list[str]:
    """One table per task kind: each method's mean score at each context length."""
    methods, kinds, lengths = _ordered(records)
    grid = score_grid(records)
    lines: list[str] = []
    for kind in kinds:
        lines += ["", f"## {kind.value} ({METRIC[kind]}) by context length", ""]
        lines.append(_row(["method", *lengths]))
        lines.append(_row(["---"] * (len(lengths) + 1)))
        for m in methods:
            lines.append(_row([m] + [f"{grid[kind.value][m][n]:.2f}" for n in lengths]))
    return lines


def markdown(records: list[RunRecord], *, title: str) -> str:
    """Scores with intervals and cost, paired differences from plain, then score by length."""
    _, kinds, lengths = _ordered(records)
    per_kind = {k: len({r.task_id for r in records if r.kind is k}) for k in kinds}
    lines = [
        f"# {title}",
        "",
        f"Tasks per kind: {', '.join(f'{k.value} {n}' for k, n in per_kind.items())}; context "
        f"lengths {lengths} (document tokens). Scores are means with 95% bootstrap intervals "
        "over tasks; *invented* is the share of answers naming a number or name that is not in "
        "the document; cost columns are means per task.",
        "",
        *_summary_table(records, kinds),
        *_paired_table(records, kinds),
        *_by_length_tables(records),
    ]
    return "\n".join(lines) + "\n"


def to_json(records: list[RunRecord], config: dict[str, Any]) -> str:
    return json.dumps(
        {
            "config": config,
            "summary": [asdict(s) for s in summarize(records)],
            "paired": [asdict(c) for c in compare(records)],
            "by_length": score_grid(records),
            "records": [asdict(r) for r in records],
        },
        indent=2,
    )


def plot(records: list[RunRecord], path: Path, *, title: str) -> None:
    """One panel per task kind and one for all tasks: each method's mean with its interval."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    _, kinds, _ = _ordered(records)
    summaries = summarize(records)
    panels = [(f"{k.value} ({METRIC[k]})", k.value) for k in kinds] + [("all tasks", None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels) + 1, 3.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, kind) in zip(axes[0], panels, strict=True):
        for i, s in enumerate(summaries):
            iv = s.mean_score if kind is None else s.by_kind[kind]
            ax.bar(i, iv.mean, color=colours[i % len(colours)], label=s.method)
            ax.errorbar(i, iv.mean, yerr=[[iv.mean - iv.low], [iv.high - iv.mean]], color="k")
        ax.set_title(name, fontsize=10)
        ax.set_xticks([])
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("score (95% bootstrap interval)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(
    records: list[RunRecord], out_dir: Path, config: dict[str, Any], *, title: str
) -> dict[str, Path]:
    """results.md, results.json and results.png in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out_dir / "results.md",
        "json": out_dir / "results.json",
        "png": out_dir / "results.png",
    }
    paths["markdown"].write_text(markdown(records, title=title))
    paths["json"].write_text(to_json(records, config))
    plot(records, paths["png"], title=title)
    return paths
