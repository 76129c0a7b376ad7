"""A replay's summary under the key names `wim sim` prints, so that a live run and a simulated
one compare key by key: `policy, replicas, completed, ttft_mean_s, ttft_p95_s, ttft_p99_s,
e2e_mean_s, requests_per_s, prefix_reuse`, plus `ttft_p50_s`, `failed` and `not_sent`.

Pure (no HTTP, no service): `replay.py` and `compare_sim.py` use it, and the unit tests
check its arithmetic. The simulator keeps its own copy in `wim_service/sim/` for now; the two
are to be merged into one module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The simulator's columns, in its order; then the replay's own.
SIM_KEYS = (
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
REPLAY_KEYS = ("ttft_p50_s", "failed", "not_sent")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default, so either side of the comparison can compute it); None without values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    records: Iterable[Mapping[str, Any]], *, policy: str, replicas: int, span_s: float
) -> dict[str, Any]:
    """The summary of a replay's per-request records.

    A record has `status` ("ok" when completed; "failed", "cancelled" or "not_sent"
    otherwise), `ttft_s` and `e2e_s` (from its arrival), and `prompt_tokens` and
    `cached_tokens` when the service reported them. Latencies and prefix reuse count the
    completed requests only; `requests_per_s` is completed requests over `span_s` (the
    trace's start to the last request's end). `prefix_reuse` is the share of prompt tokens
    served from cache (None when no request reported its tokens)."""
    records = list(records)
    done = [r for r in records if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in done]
    prompt = sum(r.get("prompt_tokens") or 0 for r in done)
    cached = sum(r.get("cached_tokens") or 0 for r in done)
    return {
        "policy": policy,
        "replicas": replicas,
        "completed": len(done),
        "ttft_mean_s": mean(ttft),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_mean_s": mean([r["e2e_s"] for r in done]),
        "requests_per_s": len(done) / span_s if span_s > 0 else None,
        "prefix_reuse": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttft, 50),
        "failed": sum(r["status"] in ("failed", "cancelled") for r in records),
        "not_sent": sum(r["status"] == "not_sent" for r in records),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_table(summaries: Sequence[Mapping[str, Any]], keys: Sequence[str] = SIM_KEYS) -> str:
    """Summaries as the simulator prints them: one aligned row per policy, `keys` as
    columns."""
    rows = [list(keys), *([_cell(s.get(k)) for k in keys] for s in summaries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keys))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    )
