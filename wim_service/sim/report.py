"""The replay's summary: one row per policy and fleet size, as a table and as JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wim_service.sim.replay import RunResult

# Dynamo's replay table: completed requests, TTFT (mean, p95, p99), mean end-to-end latency,
# throughput, and the share of prompt tokens served from a cache.
KEYS = (
    "policy",
    "replicas",
    "completed",
    "ttft_mean_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "requests_per_s",
    "prefix_reuse",
)
EXTRA_KEYS = (
    "requests",
    "too_large",
    "queued_for_room",
    "unplaced",
    "copies_opened",
    "copies_retired",
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(result: RunResult) -> dict[str, Any]:
    outcomes = result.outcomes
    ttft = [o.first_token_s - o.arrival_s for o in outcomes]
    e2e = [o.end_s - o.arrival_s for o in outcomes]
    span = max((o.end_s for o in outcomes), default=0.0) - min(
        (o.arrival_s for o in outcomes), default=0.0
    )
    prompt = sum(o.prompt_tokens for o in outcomes)
    row: dict[str, Any] = {
        "policy": result.policy,
        "replicas": result.replicas,
        "completed": len(outcomes),
        "ttft_mean_s": round(sum(ttft) / len(ttft), 3) if ttft else math.nan,
        "ttft_p95_s": round(percentile(ttft, 95), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "e2e_mean_s": round(sum(e2e) / len(e2e), 3) if e2e else math.nan,
        "requests_per_s": round(len(outcomes) / span, 3) if span > 0 else math.nan,
        "prefix_reuse": round(sum(o.cached_tokens for o in outcomes) / prompt, 4)
        if prompt
        else 0.0,
    }
    row.update({key: getattr(result, key) for key in EXTRA_KEYS})
    return row


HEADERS = {
    "policy": "policy",
    "replicas": "replicas",
    "completed": "completed",
    "ttft_mean_s": "TTFT mean s",
    "ttft_p95_s": "TTFT p95 s",
    "ttft_p99_s": "TTFT p99 s",
    "e2e_mean_s": "e2e mean s",
    "requests_per_s": "req/s",
    "prefix_reuse": "prefix reuse",
    "queued_for_room": "queued",
    "too_large": "too large",
    "copies_opened": "copies",
}


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as a Markdown table, one line per policy and fleet size."""
    keys = list(HEADERS)
    cells = [[_cell(row[key], key) for key in keys] for row in rows]
    widths = [max(len(HEADERS[k]), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = [
        "| " + " | ".join(HEADERS[k].ljust(w) for k, w in zip(keys, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for cell in cells:  # names flush left, numbers flush right
        padded = [cell[0].ljust(widths[0])]
        padded += [c.rjust(w) for c, w in zip(cell[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


def _cell(value: Any, key: str) -> str:
    if key == "prefix_reuse":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def plot_p95(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """p95 TTFT against fleet size, one line per policy (log-log: fleets double)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = sorted((r["replicas"], r["ttft_p95_s"]) for r in rows if r["policy"] == policy)
        ax.plot([n for n, _ in mine], [p for _, p in mine], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("engine replicas")
    ax.set_ylabel("p95 time to first token, s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
