"""Fit a profile's costs to its samples, and check the fit (pure: no engine).

Every fit is a least squares of the relative errors: samples span a tenth of a second to a
minute, and plain least squares fits the longest ones and misses short prefills severalfold
(docs/routing.md, "the calibration"). A coefficient that comes out negative (noise on a cost
too small to see) is fixed at zero and the others refitted, so that a profile never predicts
that more tokens save time.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from wim_service.placement.profile import (
    DecodeCost,
    DecodeSample,
    EngineProfile,
    PrefillCost,
    PrefillSample,
    QuerySample,
    RestoreCost,
    RestoreSample,
    Sample,
)

# The kinds of sample, in the order the fit's errors are reported.
KINDS = ("prefill", "decode", "query", "restore")
# The search range of `query_extra_tokens`: a few early answers' prompts (each a query, notes
# and a template).
MAX_EXTRA_TOKENS = 2048


def nonnegative_lstsq(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a coefficient that comes out negative is
    fixed at zero and the rest refitted (an active set, enough for three costs)."""
    free = list(range(columns.shape[1]))
    coef = np.zeros(columns.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(columns[:, free], target, rcond=None)
        if (solution >= 0).all():
            coef[free] = solution
            break
        del free[int(np.argmin(solution))]
    return coef


def relative_lstsq(columns: np.ndarray, seconds: Sequence[float]) -> np.ndarray:
    """`nonnegative_lstsq` of the relative errors: each row divided by its measurement."""
    target = np.asarray(seconds, dtype=float)
    return nonnegative_lstsq(columns / target[:, None], np.ones_like(target))


def prefill_columns(new: float, cached: float) -> list[float]:
    return [1.0, new, new * (cached + new / 2)]


def decode_columns(batch: float, context: float) -> list[float]:
    return [1.0, batch, context]


def fit_prefill(samples: Iterable[Sample]) -> PrefillCost:
    """`PrefillCost` fitted to the prefill samples:
    `fixed_s + new * (per_token_s + per_token_context_s * (cached + new / 2))`."""
    rows = [s for s in samples if isinstance(s, PrefillSample)]
    columns = np.array([prefill_columns(s.new, s.cached) for s in rows])
    fixed, per_token, per_context = relative_lstsq(columns, [s.seconds for s in rows])
    # A zero per-token cost would make prefill free; the profile refuses it (gt=0).
    return PrefillCost(
        fixed_s=fixed, per_token_s=max(per_token, 1e-9), per_token_context_s=per_context
    )


def fit_decode(samples: Iterable[Sample]) -> DecodeCost:
    """`DecodeCost` fitted to the decode samples:
    `fixed_s + batch * per_sequence_s + context * per_context_token_s`."""
    rows = [s for s in samples if isinstance(s, DecodeSample)]
    columns = np.array([decode_columns(s.batch, s.context) for s in rows])
    fixed, per_sequence, per_context = relative_lstsq(columns, [s.seconds for s in rows])
    return DecodeCost(fixed_s=fixed, per_sequence_s=per_sequence, per_context_token_s=per_context)


def restore_medians(samples: Iterable[Sample]) -> dict[int, float]:
    """The median seconds of the restore samples of each document size, by size: what the
    restore cost is fitted to. A restore is one engine step, so a burst of other work on a
    shared machine slows one sample severalfold, where a prefill's many steps average it
    out (docs/kv-store.md)."""
    sizes: dict[int, list[float]] = {}
    for sample in samples:
        if isinstance(sample, RestoreSample):
            sizes.setdefault(sample.tokens, []).append(sample.seconds)
    return {tokens: statistics.median(seconds) for tokens, seconds in sorted(sizes.items())}


def fit_restore(samples: Iterable[Sample]) -> RestoreCost | None:
    """`RestoreCost` (`fixed_s + tokens * per_token_s`) fitted to each size's median restore;
    None without any restore sample."""
    medians = restore_medians(samples)
    if not medians:
        return None
    columns = np.array([[1.0, tokens] for tokens in medians])
    fixed, per_token = relative_lstsq(columns, list(medians.values()))
    return RestoreCost(fixed_s=fixed, per_token_s=per_token)


def lone_query_seconds(profile: EngineProfile, sample: QuerySample) -> float:
    """What `profile` predicts for a WiM query sample."""
    return profile.lone_query_seconds(
        sample.document, sample.query, sample.margins, round(sample.margin_tokens)
    )


def fit_query_extra(profile: EngineProfile) -> int:
    """`query_extra_tokens`: the count (0 to `MAX_EXTRA_TOKENS`) with which `profile`
    predicts the WiM query samples that wrote margins with the least squared relative error
    (0 without such samples)."""
    rows = [s for s in profile.samples if isinstance(s, QuerySample) and s.margins > 0]

    def error(tokens: int) -> float:
        trial = profile.model_copy(update={"query_extra_tokens": tokens})
        return sum((lone_query_seconds(trial, s) / s.seconds - 1) ** 2 for s in rows)

    return min(range(MAX_EXTRA_TOKENS + 1), key=error) if rows else 0


def refit(profile: EngineProfile) -> EngineProfile:
    """`profile` with its costs fitted again to its own samples."""
    samples = profile.samples
    prefill, decode, restore = fit_prefill(samples), fit_decode(samples), fit_restore(samples)
    fitted = profile.model_copy(
        update={"prefill": prefill, "decode": decode, "restore": restore or profile.restore}
    )
    return fitted.model_copy(update={"query_extra_tokens": fit_query_extra(fitted)})


def predicted(profile: EngineProfile, sample: Sample) -> float:
    """What `profile` predicts for one sample."""
    match sample:
        case PrefillSample():
            return profile.prefill.seconds(sample.new, sample.cached)
        case DecodeSample():
            return profile.decode.step_seconds(sample.batch, int(sample.context))
        case QuerySample():
            return lone_query_seconds(profile, sample)
        case RestoreSample():
            return profile.read_seconds(sample.tokens, saved=True)


def fit_errors(profile: EngineProfile) -> dict[str, float]:
    """Mean absolute relative error of the profile's predictions over its samples, by kind."""
    errors: dict[str, list[float]] = {}
    for sample in profile.samples:
        error = abs(predicted(profile, sample) / sample.seconds - 1)
        errors.setdefault(sample.kind, []).append(error)
    return {kind: float(np.mean(errors[kind])) for kind in KINDS if kind in errors}


def shape(sample: Sample) -> str:
    """What one sample measured, in words."""
    match sample:
        case PrefillSample():
            return f"prefill new={sample.new} cached={sample.cached}"
        case DecodeSample():
            return f"decode batch={sample.batch} context={sample.context:.0f}"
        case QuerySample():
            return f"WiM query document={sample.document} margins={sample.margins}"
        case RestoreSample():
            return f"restore tokens={sample.tokens} computed={sample.computed}"


def describe(profile: EngineProfile) -> list[str]:
    """One line per sample, predicted against measured, then the fit's errors."""
    lines = [
        f"{shape(s)}: measured {s.seconds:.4f} s, predicted {predicted(profile, s):.4f} s"
        for s in profile.samples
    ]
    errors = fit_errors(profile)
    lines.append(", ".join(f"{kind} MARE {error:.1%}" for kind, error in errors.items()))
    lines.append(f"query_extra_tokens {profile.query_extra_tokens}")
    return lines
