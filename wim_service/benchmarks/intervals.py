"""How far a benchmark ratio can be trusted: a 95% interval over its rounds.

A ratio measured side by side still varies round by round (the rounds cycle through queries
that write different margins, and the machine's load drifts): single rounds of (b) ranged
0.69-1.21 in one run, and a 4-round run gave (d) 1.30 where 8-round runs gave 1.14-1.17. The
interval says which differences between two runs are changes rather than noise.

It is Student's t-interval of the mean of the per-round ratios: with the 2-8 rounds a
benchmark run affords, a percentile bootstrap cannot reach past the smallest and largest
round and comes out too narrow, while the t-interval widens honestly as rounds get fewer (it
assumes the per-round ratios scatter roughly normally).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% critical values of Student's t for 1-30 degrees of freedom.
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z_975 = 1.959964


def t_critical(df: int) -> float:
    """The 97.5th percentile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError("a t-interval needs at least one degree of freedom")
    if df <= len(_T_975):
        return _T_975[df - 1]
    # Past the table, the Cornish-Fisher expansion around the normal quantile (Abramowitz and
    # Stegun 26.7.5): within 1e-4 of the exact value from 31 degrees of freedom on.
    z = _Z_975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


@dataclass(frozen=True)
class RoundsInterval:
    """The mean of per-round values and its 95% t-interval: no bounds with one round (None,
    which JSON carries as null; NaN would make the saved file unreadable to strict parsers)."""

    mean: float
    low: float | None
    high: float | None
    rounds: int

    def __str__(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.mean:.3f} (1 round: no interval)"
        half = (self.high - self.low) / 2
        return (
            f"{self.mean:.3f} ± {half:.3f} [{self.low:.3f}, {self.high:.3f}] "
            f"(95% t-interval, {self.rounds} rounds)"
        )


def t_interval(values: Sequence[float]) -> RoundsInterval:
    """Mean of `values` ± t(0.975, n-1) · s / √n, s the sample standard deviation."""
    if not values:
        raise ValueError("no rounds to summarize")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return RoundsInterval(mean, None, None, len(values))
    half = t_critical(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return RoundsInterval(mean, mean - half, mean + half, len(values))
