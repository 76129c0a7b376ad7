"""Calibration: the fits recover known costs, and a quick calibration of a real engine measures
every sample of its plan and fits its profile to them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from pydantic import ValidationError

from tests.conftest import TEST_ENGINE
from wim_service.engine.calibration.fit import (
    describe,
    fit_decode,
    fit_errors,
    fit_prefill,
    nonnegative_lstsq,
    predicted,
    refit,
)
from wim_service.engine.calibration.probe import Probe
from wim_service.engine.calibration.queries import QUERY_PLACES, query_document
from wim_service.engine.calibration.restores import temporary_kv_store
from wim_service.engine.calibration.run import margin_prompt_tokens
from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import STORE_ENV
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.placement.profile import (
    DecodeCost,
    DecodeSample,
    EngineProfile,
    PrefillCost,
    PrefillSample,
    QuerySample,
    RestoreSample,
    Sample,
)
from wim_service.wim.capacity import JobShape
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder

PREFILL_COST = PrefillCost(fixed_s=0.03, per_token_s=0.0024, per_token_context_s=2e-7)
DECODE_COST = DecodeCost(fixed_s=0.045, per_sequence_s=0.0012, per_context_token_s=3e-6)


def prefill_samples(noise: float = 0.0) -> list[Sample]:
    rng = np.random.default_rng(1)
    return [
        PrefillSample(
            new=new,
            cached=cached,
            seconds=PREFILL_COST.seconds(new, cached) * (1 + noise * rng.standard_normal()),
        )
        for new in (256, 1024, 2048, 4096, 6000)
        for cached in (0, 3072)
    ]


def decode_samples(noise: float = 0.0) -> list[Sample]:
    rng = np.random.default_rng(2)
    return [
        DecodeSample(
            batch=batch,
            context=batch * context,
            seconds=DECODE_COST.step_seconds(batch, batch * context)
            * (1 + noise * rng.standard_normal()),
            steps=48,
        )
        for batch in (1, 4, 16, 32)
        for context in (200, 3000)
    ]


def test_fits_recover_the_costs_that_made_exact_samples() -> None:
    prefill, decode = fit_prefill(prefill_samples()), fit_decode(decode_samples())
    for fitted, true in ((prefill, PREFILL_COST), (decode, DECODE_COST)):
        assert fitted.model_dump() == pytest.approx(true.model_dump(), rel=1e-6)


def test_fits_of_noisy_samples_stay_near_the_costs() -> None:
    prefill, decode = fit_prefill(prefill_samples(0.03)), fit_decode(decode_samples(0.03))
    assert prefill.per_token_s == pytest.approx(PREFILL_COST.per_token_s, rel=0.1)
    assert decode.fixed_s == pytest.approx(DECODE_COST.fixed_s, rel=0.1)
    assert decode.per_context_token_s == pytest.approx(DECODE_COST.per_context_token_s, rel=0.1)


def test_a_coefficient_that_fits_negative_is_zero_and_the_rest_refitted() -> None:
    """Prefill that looks cheaper per token at long contexts (noise, a quicker kernel) must
    not make the profile predict that more context saves time."""
    columns = np.array([[1.0, n, n * n / 2] for n in (256.0, 1024.0, 2048.0, 4096.0)])
    target = 0.01 + 0.002 * columns[:, 1] - 1e-8 * columns[:, 2]
    assert np.linalg.lstsq(columns, target, rcond=None)[0][2] < 0
    coef = nonnegative_lstsq(columns, target)
    assert coef[2] == 0 and coef[0] >= 0 and coef[1] > 0
    refit = np.linalg.lstsq(columns[:, :2], target, rcond=None)[0]
    assert coef[:2] == pytest.approx(refit)


def test_the_profile_reports_its_fit_over_its_samples() -> None:
    samples = prefill_samples() + decode_samples()
    profile = EngineProfile.load().model_copy(
        update={"prefill": PREFILL_COST, "decode": DECODE_COST, "samples": samples}
    )
    assert fit_errors(profile) == pytest.approx({"prefill": 0.0, "decode": 0.0}, abs=1e-12)
    assert predicted(profile, samples[0]) == pytest.approx(samples[0].seconds)
    lines = describe(profile)
    assert lines[0].startswith("prefill new=256 cached=0: measured ")
    assert lines[-2] == "prefill MARE 0.0%, decode MARE 0.0%"


def test_samples_are_told_apart_by_their_kind_by_name() -> None:
    """A profile's samples load as their own types, by a `kind` that names them; a kind of
    none of them, or a sample with another kind's fields, is refused."""
    profile = EngineProfile.load()
    kinds = {type(s): s.kind for s in profile.samples}
    assert kinds == {
        PrefillSample: "prefill",
        DecodeSample: "decode",
        QuerySample: "query",
        RestoreSample: "restore",
    }
    data = json.loads(profile.model_dump_json())
    assert EngineProfile.model_validate(data) == profile
    for bad in (
        {"kind": 0.0, "new": 1, "cached": 0, "seconds": 1.0},
        {**data["samples"][0], "batch": 4},
    ):
        with pytest.raises(ValidationError):
            EngineProfile.model_validate(data | {"samples": [bad]})


def query_samples(profile: EngineProfile, scale: float = 1.0) -> list[Sample]:
    """WiM query samples as `profile` predicts them, times `scale`."""
    shapes = [(1200, 12, 1, 16.0), (2400, 12, 1, 14.0), (3600, 13, 2, 15.5), (3600, 13, 0, 0)]
    return [
        QuerySample(
            document=d,
            query=q,
            margins=m,
            margin_tokens=t,
            seconds=profile.lone_query_seconds(d, q, m, round(t)) * scale,
        )
        for d, q, m, t in shapes
    ]


def test_the_query_extra_is_what_queries_with_margins_prefill_beyond_their_own() -> None:
    base = EngineProfile.load().model_copy(
        update={"prefill": PREFILL_COST, "decode": DECODE_COST, "query_extra_tokens": 0}
    )
    costs = prefill_samples() + decode_samples()
    made = query_samples(base.model_copy(update={"query_extra_tokens": 120}))
    profile = refit(base.model_copy(update={"samples": costs + made}))
    assert profile.query_extra_tokens == 120
    assert fit_errors(profile)["query"] == pytest.approx(0.0, abs=1e-9)
    # A query without margins (every segment skipped) answers at once: nothing extra.
    assert predicted(profile, made[-1]) == pytest.approx(predicted(base, made[-1]))
    # Never below zero: queries quicker than the costs say add nothing.
    quick = refit(base.model_copy(update={"samples": costs + query_samples(base, 0.8)}))
    assert quick.query_extra_tokens == 0


def test_the_calibration_document_puts_each_code_in_a_segment_of_its_own(tokenizer) -> None:
    text = query_document(tokenizer, 2400)
    tokens = len(tokenizer.encode_user_text(text).ids)
    assert 2200 < tokens < 2600
    starts = [text.index(f"for the {place} is") for place in QUERY_PLACES]
    assert starts == sorted(starts)
    # 1/6, 1/2 and 5/6 of the way in: 512-token segments apart (WiM's default segment).
    for start, depth in zip(starts, (1 / 6, 1 / 2, 5 / 6), strict=True):
        assert abs(start / len(text) - depth) < 0.02


def test_margin_prompt_tokens_are_the_job_shapes(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, WiMOptions().prompts)
    tokens = margin_prompt_tokens(builder)
    shape = JobShape.of(
        builder, context_tokens=0, document_tokens=0, segments=1, options=WiMOptions(), query="?"
    )
    # A 10-word query adds its words to the bare instruction.
    assert shape.margin_prompt_tokens + 8 < tokens < shape.margin_prompt_tokens + 40


def kv_tokens(model_dir: Path, gib: float, block: int) -> int:
    """The KV pool's tokens from the model's shape: float32 keys and values of every layer,
    whole blocks, less vLLM's null block."""
    shape = json.loads((model_dir / "config.json").read_text())
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 4
    return (int(gib * 2**30) // (per_token * block) - 1) * block


def test_a_temporary_kv_store_leaves_neither_its_directory_nor_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.setenv(MASTER_KEY_ENV, "the deployment's key")
    with temporary_kv_store(EngineConfig()) as config:
        assert config.kv_store is not None and Path(config.kv_store).is_dir()
        assert os.environ[MASTER_KEY_ENV] != "the deployment's key"
    assert not Path(config.kv_store).exists()
    assert os.environ[MASTER_KEY_ENV] == "the deployment's key"
    assert STORE_ENV not in os.environ


@pytest.mark.engine
@pytest.mark.timeout(300)
async def test_quick_calibration_of_a_real_engine(engine, model_dir) -> None:
    """The quick plan on the tests' shared engine (`TEST_ENGINE`): what `calibrate` measures
    after starting one (it only adds the engine's start and `asyncio.run`).

    The timings are a shared machine's (the other worker's engines run beside it): CI's
    runner once took 0.176 s for a decode step the fit put at 0.058 s, and once fitted both
    decode slopes to zero. So this checks what was measured (every sample of the plan, real
    cache hits, real decode steps, real margins) and that the profile is the fit of those
    samples; how well a fit predicts its machine is what `wim calibrate` prints (its fit
    errors), measured on a quiet machine, not a test's assertion (docs/testing.md)."""
    from wim_service.engine.calibration.probe import QUICK
    from wim_service.engine.calibration.run import calibrate_on

    profile = await calibrate_on(engine, quick=True)
    samples = profile.samples
    assert all(0 < s.seconds < 300 for s in samples)
    # Every prefill of the plan, the cached ones served from the engine's cache (the engine's
    # own count: block-aligned prefixes).
    prefills = {(s.new, s.cached) for s in samples if isinstance(s, PrefillSample)}
    assert prefills == {(n, c) for n in QUICK.prefill_new for c in QUICK.prefill_cached}
    # Every decode batch of the plan, timed over steps every sequence took part in.
    decodes = [s for s in samples if isinstance(s, DecodeSample)]
    shapes = {(s.batch, s.context / s.batch) for s in decodes}
    lengths = [c + QUICK.decode_tokens / 2 for c in QUICK.decode_contexts]
    assert shapes == {(b, n) for b in QUICK.decode_batches for n in lengths}
    assert all(0 < s.steps <= QUICK.decode_tokens for s in decodes)
    # Each calibration query asked for one place's code: one margin written, the rest skipped.
    queries = [s for s in samples if isinstance(s, QuerySample)]
    assert [s.margins for s in queries] == [1, 1]
    assert all(0 < s.margin_tokens <= 16 and s.document > 1000 for s in queries)
    # The costs are the fit of those samples (the fits' own tests are above).
    assert refit(profile) == profile
    assert profile.kv_capacity_tokens == kv_tokens(model_dir, TEST_ENGINE.kv_cache_gib, 32)
    assert profile.block_tokens == TEST_ENGINE.block_size
    assert profile.max_batch == TEST_ENGINE.max_num_seqs
    assert profile.dtype == "float32" and 0 < profile.margin_prompt_tokens < 200
    assert EngineProfile.model_validate_json(profile.model_dump_json()) == profile


async def test_a_decode_batch_without_a_shared_step_is_no_sample() -> None:
    """A batch whose sequences never decode side by side (one ended before the last one
    started, as on a loaded machine) gives no step time to record: no sample, not a NaN."""
    vocab = SimpleNamespace(get_vocab_size=lambda: 50_000)
    probe = Probe(cast(Any, SimpleNamespace(engine=SimpleNamespace(model_config=vocab))))
    turns = iter([(0.1, [0.1], 0), (0.5, [1.0, 2.0], 0), (2.5, [3.0, 4.0], 0)])

    async def run(prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        return next(turns)

    probe.run = run  # type: ignore[method-assign]
    assert await probe.decode(2, 200, 2) is None
