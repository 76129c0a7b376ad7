"""The summary of a replay, simulated (`wim sim`) or live (`loadtest/replay.py`): one row per
policy and fleet size, as a table and as JSON, under the same keys so that the two compare key
by key. A figure with nothing to compute it from (no completed request) is None: JSON's null,
`-` in the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wim_service.sim.result import RunResult

# Dynamo's replay table: completed requests, TTFT (mean, p95, p99), mean end-to-end latency,
# throughput, and the share of prompt tokens served from a cache; the TTFT p50 that the
# live comparison (loadtest/compare_sim.py) checks with the p95; and goodput, the answers per
# second that ended within the deadline (the throughput that counts once a fleet is saturated).
KEYS = (
    "policy",
    "replicas",
    "completed",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "requests_per_s",
    "prefix_reuse",
    "goodput_per_s",
)
EXTRA_KEYS = (
    "requests",
    "too_large",
    "refused",
    "turned_away",
    "timed_out",
    "retried",
    "copies_opened",
    "copies_retired",
    "copies_reclaimed",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the closest ranks (numpy's default);
    None without values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    if rank == low:  # on a rank: its value, even beside an infinite one (`_p95_of_all`)
        return ordered[low]
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def figures(
    ttft: Sequence[float],
    e2e: Sequence[float],
    *,
    prompt_tokens: int,
    cached_tokens: int,
    span_s: float,
    deadline_s: float = math.inf,
    offered_s: float | None = None,
) -> dict[str, Any]:
    """The figures of `KEYS` from the completed requests' TTFTs and end-to-end latencies (s,
    from each request's first send), their prompt tokens and those of them served from a
    cache, over `span_s` seconds; goodput counts the answers within `deadline_s`, per second
    of `offered_s` if given (the trace's arrivals: the same for every policy, where late
    answers would stretch `span_s` and count against a policy twice), else of `span_s`."""
    good = sum(latency <= deadline_s for latency in e2e)
    good_over_s = span_s if offered_s is None else offered_s
    return {
        "completed": len(ttft),
        "ttft_mean_s": _rounded(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_p50_s": _rounded(percentile(ttft, 50)),
        "ttft_p95_s": _rounded(percentile(ttft, 95)),
        "ttft_p99_s": _rounded(percentile(ttft, 99)),
        "e2e_mean_s": _rounded(sum(e2e) / len(e2e)) if e2e else None,
        "requests_per_s": _rounded(len(ttft) / span_s) if span_s > 0 else None,
        "prefix_reuse": _rounded(cached_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "goodput_per_s": _rounded(good / good_over_s) if good_over_s > 0 else None,
    }


def summarise(result: RunResult) -> dict[str, Any]:
    outcomes = result.outcomes
    span = max((o.end_s for o in outcomes), default=0.0) - min(
        (o.arrival_s for o in outcomes), default=0.0
    )
    ttft = [o.first_token_s - o.arrival_s for o in outcomes]
    row: dict[str, Any] = {"policy": result.policy, "replicas": result.replicas}
    row |= figures(
        ttft,
        [o.end_s - o.arrival_s for o in outcomes],
        prompt_tokens=sum(o.prompt_tokens for o in outcomes),
        cached_tokens=sum(o.cached_tokens for o in outcomes),
        span_s=span,
        deadline_s=result.deadline_s,
        offered_s=result.offered_s,
    )
    row.update({key: getattr(result, key) for key in EXTRA_KEYS})
    unanswered = result.requests - result.too_large - len(outcomes)
    row["ttft_p95_all_s"] = _p95_of_all(ttft, unanswered)
    return row


def _p95_of_all(ttft: list[float], unanswered: int) -> float | None:
    """TTFT p95 over every request that fits a replica: the answers' `ttft`, and `unanswered`
    requests (refused, stopped at the deadline, failed) counting as never answered; None where
    the 95th percentile falls among those. A row's `ttft_p95_s` is over its own answers, so a
    policy that answers a slow request another refuses raises its own p95 by it: this one
    compares policies over the same requests."""
    p95 = percentile(ttft + [math.inf] * unanswered, 95)
    return _rounded(p95) if p95 is not None and math.isfinite(p95) else None


HEADERS = {
    "policy": "policy",
    "replicas": "replicas",
    "completed": "completed",
    "ttft_mean_s": "TTFT mean s",
    "ttft_p50_s": "TTFT p50 s",
    "ttft_p95_s": "TTFT p95 s",
    "ttft_p95_all_s": "p95 of all s",
    "ttft_p99_s": "TTFT p99 s",
    "e2e_mean_s": "e2e mean s",
    "requests_per_s": "req/s",
    "prefix_reuse": "prefix reuse",
    "goodput_per_s": "goodput/s",
    "refused": "refused",
    "timed_out": "timed out",
    "too_large": "too large",
    "copies_opened": "copies",
}


def table(rows: Sequence[dict[str, Any]], keys: Sequence[str] = tuple(HEADERS)) -> str:
    """Rows as a Markdown table, one line per policy and fleet size; `keys` as columns (a key
    without a header of its own is its header; a row without the key shows `-`)."""
    names = [HEADERS.get(key, key) for key in keys]
    cells = [[_cell(row.get(key), key) for key in keys] for row in rows]
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, name in enumerate(names)]
    lines = [
        "| " + " | ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for cell in cells:  # names flush left, numbers flush right
        padded = [cell[0].ljust(widths[0])]
        padded += [c.rjust(w) for c, w in zip(cell[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key == "prefix_reuse":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def plot_p95(
    rows: Sequence[dict[str, Any]], path: Path, *, title: str, floor_s: float | None = None
) -> None:
    """p95 TTFT against fleet size, one line per policy (log-log: fleets double), and the
    p95 no placement beats (`sim/floor.py`) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = sorted((r["replicas"], r["ttft_p95_s"]) for r in rows if r["policy"] == policy)
        ax.plot([n for n, _ in mine], [p for _, p in mine], marker="o", label=policy)
    if floor_s is not None:
        ax.axhline(floor_s, color="grey", linestyle="--", label="floor (no placement beats)")
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
