"""Tables (markdown, JSON) and a plot of score against context length, per method."""

from __future__ import annotations

import json
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
    TaskKind.AGGREGATION: "F1",
}


@dataclass(frozen=True)
class MethodSummary:
    """A method's scores per task kind (mean over lengths and samples) and its mean cost."""

    method: str
    by_kind: dict[str, float]
    mean_score: float
    prompt_tokens_computed: float
    generated_tokens: float
    wall_s: float
    errors: int


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
                by_kind={k.value: _mean(r.score for r in mine if r.kind is k) for k in kinds},
                mean_score=_mean(r.score for r in mine),
                prompt_tokens_computed=_mean(r.result.prompt_tokens_computed for r in mine),
                generated_tokens=_mean(r.result.generated_tokens for r in mine),
                wall_s=_mean(r.result.wall_s for r in mine),
                errors=sum(r.result.error is not None for r in mine),
            )
        )
    return summaries


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(records: list[RunRecord], *, title: str) -> str:
    """The summary table (scores and cost per method), then score by context length per kind."""
    methods, kinds, lengths = _ordered(records)
    samples = len({r.task_id for r in records}) // max(len(kinds) * len(lengths), 1)
    lines = [
        f"# {title}",
        "",
        f"{samples} task(s) per kind and length; context lengths {lengths} (document tokens).",
        "Cost columns are means per task.",
        "",
        _row(
            ["method"]
            + [f"{k.value} ({METRIC[k]})" for k in kinds]
            + ["mean", "prompt tokens computed", "generated tokens", "wall s", "errors"]
        ),
        _row(["---"] * (len(kinds) + 6)),
    ]
    for s in summarize(records):
        lines.append(
            _row(
                [s.method]
                + [f"{s.by_kind[k.value]:.2f}" for k in kinds]
                + [
                    f"{s.mean_score:.2f}",
                    f"{s.prompt_tokens_computed:.0f}",
                    f"{s.generated_tokens:.0f}",
                    f"{s.wall_s:.1f}",
                    s.errors,
                ]
            )
        )
    grid = score_grid(records)
    for kind in kinds:
        lines += ["", f"## {kind.value} ({METRIC[kind]}) by context length", ""]
        lines.append(_row(["method", *lengths]))
        lines.append(_row(["---"] * (len(lengths) + 1)))
        for m in methods:
            lines.append(_row([m] + [f"{grid[kind.value][m][n]:.2f}" for n in lengths]))
    return "\n".join(lines) + "\n"


def to_json(records: list[RunRecord], config: dict[str, Any]) -> str:
    return json.dumps(
        {
            "config": config,
            "summary": [asdict(s) for s in summarize(records)],
            "by_length": score_grid(records),
            "records": [asdict(r) for r in records],
        },
        indent=2,
    )


def plot(records: list[RunRecord], path: Path, *, title: str) -> None:
    """One panel per task kind: score against context length, one line per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    methods, kinds, lengths = _ordered(records)
    grid = score_grid(records)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for m in methods:
            ax.plot(lengths, [grid[kind.value][m][n] for n in lengths], marker="o", label=m)
        ax.set_title(f"{kind.value} ({METRIC[kind]})")
        ax.set_xlabel("context length (tokens)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score")
    axes[0][-1].legend(fontsize=8, loc="best")
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
