"""Measure an engine's costs on the real engine and fit the `EngineProfile` placement reads.

Method (`calibrate`): one engine is started with the given config, warmed up, and timed on
plain requests of random token ids (distinct per sample, so the prefix cache serves only
what a sample means it to):

* prefill: the time to the first token of single requests (max_tokens=1) of `new` tokens,
  with nothing cached and after a prefix of `cached` tokens was sent on its own first (the
  cache then serves it; the engine's own `num_cached_tokens` is recorded). Fitted to
  `fixed_s + new * (per_token_s + per_token_context_s * (cached + new / 2))`;
* decode: batches of `batch` sequences that share a prefix of ~`context` tokens (sent first,
  so that 32 sequences of 3,000 tokens fit a 1 GiB pool, as the margins of a WiM job share
  their document) each with its own short suffix, forced to `decode_tokens` tokens; the step
  time is the time between output tokens once every sequence decodes (counted in tokens, so
  outputs the engine merged still count). Fitted to `fixed_s + batch * per_sequence_s +
  total_context * per_context_token_s`, where total_context is what the batch attends to;
* WiM queries on a document session (`engine/query_samples.py`): what they take beyond
  those two fits is `query_extra_tokens`;
* restores (`engine/restore_samples.py`, a temporary KV store): fitted to `fixed_s + tokens *
  per_token_s` (`EngineProfile.restore`); `calibrate_restore` measures only them.

Both fits are least squares of the relative errors (samples span 0.1 s to a minute; plain
least squares fits the longest and misses short prefills by 2-3x). A coefficient that comes
out negative (noise on a cost too small to see) is fixed at zero and the others refitted, so
that the profile never predicts that more tokens save time. `samples` keeps every
measurement (`fit_errors`, `describe`, `refit`).

How well the fits match on the development machine, and under what load: docs/routing.md
("wim sim", the calibration).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from wim_service.engine.config import EngineConfig
from wim_service.engine.query_samples import (
    QUERY,
    QUERY_PLACES,
    fit_query_extra,
    lone_query_seconds,
    measure_queries,
)
from wim_service.engine.request_params import PRIORITY, sampling_params
from wim_service.engine.restore_samples import (
    RESTORE,
    measure_restores,
    restore_medians,
    temporary_kv_store,
)
from wim_service.placement.profile import DecodeCost, EngineProfile, PrefillCost, RestoreCost
from wim_service.wim.backend import RequestKind
from wim_service.wim.capacity import JobShape
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend

# Decode steps timed per batch (the first few are the suffixes' prefill and are left out).
DECODE_TOKENS = 64
# Each decode sequence's own tokens after the shared prefix.
DECODE_SUFFIX = 16
# A typical 10-word query: margin_prompt_tokens counts the query's tokens in the margin prompt.
TYPICAL_QUERY = "What is the access code for the night gate at the harbor?"
# Random token ids stay clear of the vocabulary's ends (special and control tokens).
_ID_MARGIN = 1000
# Sample kinds, as floats: `EngineProfile.samples` holds dicts of floats.
PREFILL, DECODE = 0.0, 1.0


@dataclass(frozen=True)
class Plan:
    """What one calibration measures."""

    prefill_new: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    prefill_repeats: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_repeats: int
    decode_tokens: int = DECODE_TOKENS
    # Prefill samples past this many tokens (cached and new) are left out: on 2 cores a
    # 6,000-token prefill after 3,000 cached tokens alone takes a minute.
    prefill_max_tokens: int = 6144
    # Documents (tokens) read for the WiM queries, and the queries asked of each.
    query_documents: tuple[int, ...] = (1200, 2400, 3600)
    queries_per_document: int = len(QUERY_PLACES)


FULL = Plan(
    prefill_new=(256, 1024, 2048, 4096, 6000),
    prefill_cached=(0, 2048),
    prefill_repeats=2,
    decode_batches=(1, 4, 16, 32),
    decode_contexts=(200, 3000),
    decode_repeats=1,
    decode_tokens=48,
)
QUICK = Plan(
    prefill_new=(256, 1024, 2048),
    prefill_cached=(0, 1024),
    prefill_repeats=1,
    decode_batches=(1, 8),
    decode_contexts=(200, 1000),
    decode_repeats=1,
    decode_tokens=24,
    query_documents=(1200,),
    queries_per_document=2,
)


# -- fitting -------------------------------------------------------------------------------


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
    """`nonnegative_lstsq` of the relative errors: each row divided by its measurement.
    Samples span 0.1 s to a minute; plain least squares would fit the longest prefills and
    leave a 256-token one off by a factor of 2-3 (seen on this machine)."""
    target = np.asarray(seconds, dtype=float)
    return nonnegative_lstsq(columns / target[:, None], np.ones_like(target))


def refit(profile: EngineProfile) -> EngineProfile:
    """`profile` with its costs fitted again to its own samples."""
    samples = profile.samples
    prefill, decode, restore = fit_prefill(samples), fit_decode(samples), fit_restore(samples)
    fitted = profile.model_copy(
        update={"prefill": prefill, "decode": decode, "restore": restore or profile.restore}
    )
    return fitted.model_copy(update={"query_extra_tokens": fit_query_extra(fitted)})


def prefill_columns(new: float, cached: float) -> list[float]:
    return [1.0, new, new * (cached + new / 2)]


def decode_columns(batch: float, context: float) -> list[float]:
    return [1.0, batch, context]


def fit_prefill(samples: Iterable[dict[str, float]]) -> PrefillCost:
    """`PrefillCost` fitted to samples of `new`, `cached` and `seconds`."""
    rows = [s for s in samples if s["kind"] == PREFILL]
    columns = np.array([prefill_columns(s["new"], s["cached"]) for s in rows])
    fixed, per_token, per_context = relative_lstsq(columns, [s["seconds"] for s in rows])
    # A zero per-token cost would make prefill free; the profile refuses it (gt=0).
    return PrefillCost(
        fixed_s=fixed, per_token_s=max(per_token, 1e-9), per_token_context_s=per_context
    )


def fit_decode(samples: Iterable[dict[str, float]]) -> DecodeCost:
    """`DecodeCost` fitted to samples of `batch`, `context` (the batch's) and `seconds`."""
    rows = [s for s in samples if s["kind"] == DECODE]
    columns = np.array([decode_columns(s["batch"], s["context"]) for s in rows])
    fixed, per_sequence, per_context = relative_lstsq(columns, [s["seconds"] for s in rows])
    return DecodeCost(fixed_s=fixed, per_sequence_s=per_sequence, per_context_token_s=per_context)


def fit_restore(samples: Iterable[dict[str, float]]) -> RestoreCost | None:
    """`RestoreCost` fitted to restore samples (`restore_medians`); None without any."""
    medians = restore_medians(samples)
    if not medians:
        return None
    columns = np.array([[1.0, tokens] for tokens in medians])
    fixed, per_token = relative_lstsq(columns, list(medians.values()))
    return RestoreCost(fixed_s=fixed, per_token_s=per_token)


def predicted(profile: EngineProfile, sample: dict[str, float]) -> float:
    """What `profile` predicts for one sample."""
    if sample["kind"] == RESTORE:
        return profile.read_seconds(int(sample["tokens"]), saved=True)
    if sample["kind"] == PREFILL:
        return profile.prefill.seconds(int(sample["new"]), int(sample["cached"]))
    if sample["kind"] == QUERY:
        return lone_query_seconds(profile, sample)
    return profile.decode.step_seconds(int(sample["batch"]), int(sample["context"]))


KIND_NAMES = {PREFILL: "prefill", DECODE: "decode", QUERY: "query", RESTORE: "restore"}


def fit_errors(profile: EngineProfile) -> dict[str, float]:
    """Mean absolute relative error of the profile's prefill, decode and WiM query
    predictions over its samples."""
    errors: dict[str, list[float]] = {name: [] for name in KIND_NAMES.values()}
    for sample in profile.samples:
        error = abs(predicted(profile, sample) / sample["seconds"] - 1)
        errors[KIND_NAMES[sample["kind"]]].append(error)
    return {kind: float(np.mean(values)) for kind, values in errors.items() if values}


# -- measuring -----------------------------------------------------------------------------


class Probe:
    """Timed plain requests of random token ids on one running engine."""

    def __init__(self, backend: VLLMBackend, seed: int = 0) -> None:
        self.backend = backend
        self.rng = np.random.default_rng(seed)
        self.vocab = backend.engine.model_config.get_vocab_size()
        self._ids = 0

    def tokens(self, n: int) -> list[int]:
        """`n` random token ids no earlier sample used in this order (the cache misses)."""
        return self.rng.integers(_ID_MARGIN, self.vocab - _ID_MARGIN, size=n).tolist()

    async def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        """Submit one request: (its first token's delay, each later token's arrival time,
        the prompt tokens the prefix cache served)."""
        from vllm.inputs import tokens_input

        self._ids += 1
        params = sampling_params(max_tokens, exact_tokens=True)
        started = time.perf_counter()
        first, arrivals, cached = 0.0, [], 0
        stream = self.backend.engine.generate(
            tokens_input(prompt),
            params,
            f"calibration-{self._ids}",
            priority=PRIORITY[RequestKind.ANSWER],
        )
        async for output in stream:
            now = time.perf_counter()
            if not first:
                first, cached = now - started, output.num_cached_tokens or 0
            arrivals += [now] * len(output.outputs[0].token_ids)
        return first, arrivals, cached

    async def prefill(self, new: int, cached: int) -> dict[str, float]:
        """One prefill sample of `new` tokens after `cached` ones served from the cache."""
        prefix = self.tokens(cached)
        if cached:
            await self.run(prefix, 1)
        seconds, _, hit = await self.run(prefix + self.tokens(new), 1)
        return {"kind": PREFILL, "new": len(prefix) + new - hit, "cached": hit, "seconds": seconds}

    async def decode(self, batch: int, context: int, tokens: int) -> dict[str, float]:
        """One decode sample: `batch` sequences over a shared `context`-token prefix."""
        prefix = self.tokens(max(0, context - DECODE_SUFFIX))
        if prefix:
            await self.run(prefix, 1)
        runs = await asyncio.gather(
            *(self.run(prefix + self.tokens(DECODE_SUFFIX), tokens) for _ in range(batch))
        )
        arrivals = [times for _, times, _ in runs]
        # Every sequence decodes between the last one's first token and the first one's end.
        start, end = max(t[0] for t in arrivals), min(t[-1] for t in arrivals)
        steps = sum(start < t <= end for t in arrivals[0])
        step = (end - start) / steps if steps else float("nan")
        mean_length = len(prefix) + DECODE_SUFFIX + tokens / 2
        return {
            "kind": DECODE,
            "batch": batch,
            "context": batch * mean_length,
            "seconds": step,
            "steps": steps,
        }


async def measure(backend: VLLMBackend, plan: Plan) -> list[dict[str, float]]:
    """Every sample of `plan` on a running engine (warmed up first, not recorded)."""
    probe = Probe(backend)
    limit = min(backend.limits.max_model_len - 1, plan.prefill_max_tokens)
    await probe.prefill(512, 0)
    await probe.decode(4, 200, 8)
    samples: list[dict[str, float]] = []
    for _ in range(plan.prefill_repeats):
        for cached in plan.prefill_cached:
            for new in plan.prefill_new:
                if cached + new <= limit:
                    samples.append(await probe.prefill(new, cached))
    for _ in range(plan.decode_repeats):
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                if context + plan.decode_tokens <= limit:
                    sample = await probe.decode(batch, context, plan.decode_tokens)
                    if sample["steps"] > 0:
                        samples.append(sample)
    return samples


# -- the profile ---------------------------------------------------------------------------


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model and core count, as a profile records it."""
    name = "unknown CPU"
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def model_name(config: EngineConfig) -> str:
    """The model's name: its folder's, or the offline default model's."""
    from wim_service.assets.default_model import GGUF_FILE

    return Path(config.model).name if config.model else GGUF_FILE.partition(".")[0]


def margin_prompt_tokens(builder: PromptBuilder, options: WiMOptions | None = None) -> int:
    """What a margin adds after its segment with the default prompts and a typical query,
    as the job's KV bound counts it (`JobShape`, with its allowance for merges at the
    query's edges)."""
    shape = JobShape.of(
        builder,
        context_tokens=0,
        document_tokens=0,
        segments=1,
        options=options or WiMOptions(),
        query=TYPICAL_QUERY,
    )
    return shape.margin_prompt_tokens


def build_profile(
    backend: VLLMBackend, samples: list[dict[str, float]], load: Sequence[float]
) -> EngineProfile:
    """The profile of a running engine: its sizes, and costs fitted to `samples`."""
    config = backend.engine.vllm_config
    cache = config.cache_config
    builder = PromptBuilder(backend.tokenizer, WiMOptions().prompts)
    profile = EngineProfile(
        model=model_name(backend.config),
        dtype=backend.dtype,
        machine=machine(),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        load_average=(load[0], load[1], load[2]),
        block_tokens=cache.block_size,
        # vLLM's block 0 is a null block that never holds KV.
        kv_capacity_tokens=((cache.num_gpu_blocks or 1) - 1) * cache.block_size,
        max_batch=config.scheduler_config.max_num_seqs,
        margin_prompt_tokens=margin_prompt_tokens(builder),
        prefill=fit_prefill(samples),
        decode=fit_decode(samples),
        restore=fit_restore(samples),
        samples=samples,
    )
    return profile.model_copy(update={"query_extra_tokens": fit_query_extra(profile)})


def _max_load(*loads: Sequence[float]) -> list[float]:
    return [max(values) for values in zip(*loads, strict=True)]


async def calibrate_on(backend: VLLMBackend, *, quick: bool = False) -> EngineProfile:
    """Measure and fit the costs of a running engine (it stays up)."""
    load = os.getloadavg()
    plan = QUICK if quick else FULL
    queries = await measure_queries(backend, plan.query_documents, plan.queries_per_document)
    samples = await measure(backend, plan) + queries
    samples += await measure_restores(backend, Probe(backend, seed=1).tokens, quick=quick)
    return build_profile(backend, samples, _max_load(load, os.getloadavg()))


async def calibrate_async(
    config: EngineConfig, *, quick: bool = False, restore_into: EngineProfile | None = None
) -> EngineProfile:
    """`calibrate` inside a running event loop (`calibrate_restore` with `restore_into`)."""
    from wim_service.engine.vllm_engine import VLLMBackend

    with temporary_kv_store(config) as stored:
        backend = VLLMBackend.start(stored)
        # Always ends the engine: errors, cancels, the CLI's KeyboardInterrupt on SIGTERM.
        try:
            if restore_into is None:
                return await calibrate_on(backend, quick=quick)
            if mismatch := restore_into.dtype_mismatch(backend.dtype):
                raise ValueError(f"cannot add restores: {mismatch}")
            samples = [s for s in restore_into.samples if s["kind"] != RESTORE]
            samples += await measure_restores(backend, Probe(backend, seed=1).tokens, quick=quick)
            update = {"samples": samples, "restore": fit_restore(samples)}
            return restore_into.model_copy(update=update)
        finally:
            backend.shutdown()


def calibrate(config: EngineConfig, *, quick: bool = False) -> EngineProfile:
    """Start one engine with `config`, measure and fit its costs, end the engine.

    `quick` measures fewer sizes once each (~1-2 minutes on 2 cores, for tests); the full
    calibration takes ~12 minutes. Call it outside an event loop (it runs its own).
    """
    return asyncio.run(calibrate_async(config, quick=quick))


def calibrate_restore(
    config: EngineConfig, profile: EngineProfile, *, quick: bool = False
) -> EngineProfile:
    """`profile` with its restore cost measured (again) on an engine started with `config`."""
    return asyncio.run(calibrate_async(config, quick=quick, restore_into=profile))


def describe(profile: EngineProfile) -> list[str]:
    """One line per sample, predicted against measured, then the fit's errors."""
    lines = []
    for s in profile.samples:
        if s["kind"] == PREFILL:
            shape = f"prefill new={s['new']:.0f} cached={s['cached']:.0f}"
        elif s["kind"] == DECODE:
            shape = f"decode batch={s['batch']:.0f} context={s['context']:.0f}"
        elif s["kind"] == RESTORE:
            shape = f"restore tokens={s['tokens']:.0f} computed={s['computed']:.0f}"
        else:
            shape = f"WiM query document={s['document']:.0f} margins={s['margins']:.0f}"
        lines.append(
            f"{shape}: measured {s['seconds']:.4f} s, predicted {predicted(profile, s):.4f} s"
        )
    errors = fit_errors(profile)
    lines.append(", ".join(f"{kind} MARE {error:.1%}" for kind, error in errors.items()))
    lines.append(f"query_extra_tokens {profile.query_extra_tokens}")
    return lines
