"""Prefill and decode samples for calibration: timed plain requests of random token ids on
one running engine, distinct per sample so that the prefix cache serves only what a sample
means it to.

* prefill: the time to the first token of single requests (max_tokens=1) of `new` tokens,
  with nothing cached and after a prefix of `cached` tokens was sent on its own first (the
  cache then serves it; the engine's own `num_cached_tokens` is recorded);
* decode: batches of `batch` sequences that share a prefix of about `context` tokens (sent
  first, so that a batch of long sequences fits a small KV pool, as the margins of a WiM job
  share their document) each with its own short suffix, forced to `decode_tokens` tokens;
  the step time is the time between output tokens once every sequence decodes (counted in
  tokens, so outputs the engine merged still count).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from wim_service.engine.calibration.queries import QUERY_PLACES
from wim_service.engine.request_params import PRIORITY, sampling_params
from wim_service.placement.profile import DecodeSample, PrefillSample, Sample
from wim_service.wim.backend import RequestKind

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend

# Decode steps timed per batch (the first few are the suffixes' prefill and are left out).
DECODE_TOKENS = 64
# Each decode sequence's own tokens after the shared prefix.
DECODE_SUFFIX = 16
# Random token ids stay clear of the vocabulary's ends (special and control tokens).
_ID_MARGIN = 1000


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
    # Prefill samples past this many tokens (cached and new) are left out: one such sample
    # alone takes about a minute on a small CPU machine (docs/routing.md, "The engine profile").
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
# A smoke test of the whole calibration (the tests run it on the shared engine): every kind
# of sample, two sizes of each, at sizes that take seconds on one core.
QUICK = Plan(
    prefill_new=(256, 768, 1536),
    prefill_cached=(0, 512),
    prefill_repeats=1,
    decode_batches=(1, 4),
    decode_contexts=(200, 500),
    decode_repeats=1,
    decode_tokens=24,
    query_documents=(1200,),
    queries_per_document=2,
)


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

    async def prefill(self, new: int, cached: int) -> PrefillSample:
        """One prefill sample of `new` tokens after `cached` ones served from the cache."""
        prefix = self.tokens(cached)
        if cached:
            await self.run(prefix, 1)
        seconds, _, hit = await self.run(prefix + self.tokens(new), 1)
        return PrefillSample(new=len(prefix) + new - hit, cached=hit, seconds=seconds)

    async def decode(self, batch: int, context: int, tokens: int) -> DecodeSample | None:
        """One decode sample: `batch` sequences over a shared `context`-token prefix; None
        when no step had every sequence decoding (nothing to time)."""
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
        if not steps:
            return None
        mean_length = len(prefix) + DECODE_SUFFIX + tokens / 2
        seconds = (end - start) / steps
        return DecodeSample(batch=batch, context=batch * mean_length, seconds=seconds, steps=steps)


async def measure(backend: VLLMBackend, plan: Plan) -> list[Sample]:
    """Every sample of `plan` on a running engine (warmed up first, not recorded)."""
    probe = Probe(backend)
    limit = min(backend.limits.max_model_len - 1, plan.prefill_max_tokens)
    await probe.prefill(512, 0)
    await probe.decode(4, 200, 8)
    samples: list[Sample] = []
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
                    if sample is not None:
                        samples.append(sample)
    return samples
