"""The WiM mechanism on a real vLLM engine with the real default model (fp32)."""

from __future__ import annotations

import asyncio
import time

import pytest

from wim_service.wim.backend import GenerationParams, RequestKind
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import DoneEvent
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import open_document, plan_document, run_wim
from wim_service.wim.prompts import PromptBuilder

pytestmark = pytest.mark.engine

QUERY = "What is the access code for the night gate?"
OPTIONS = WiMOptions(segment_tokens=192, margin_max_tokens=24, answer_max_tokens=24)


async def run(engine, document: str, query: str = QUERY, options: WiMOptions = OPTIONS) -> list:
    return [e async for e in run_wim(engine, engine.tokenizer, document, query, options)]


async def drain(stream) -> list[int]:
    ids: list[int] = []
    async for chunk in stream:
        ids.extend(chunk.token_ids)
    return ids


async def wait_for_baseline(engine, free: int, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.kv_stats()
        if (
            stats.free_blocks == free and stats.parked_sessions == 0
        ) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


def margin_params(builder: PromptBuilder, engine) -> GenerationParams:
    yes, no = builder.relevance_token_ids()
    return GenerationParams(
        kind=RequestKind.MARGIN,
        max_tokens=OPTIONS.margin_max_tokens,
        stop_token_ids=engine.tokenizer.eos_token_ids,
        first_token_ids=yes | no,
    )


async def test_job_streams_segments_margins_answer(engine, report) -> None:
    events, arrived = [], []
    async for event in run_wim(engine, engine.tokenizer, report, QUERY, OPTIONS):
        events.append(event)
        arrived.append(time.perf_counter())
    kinds = [e.type for e in events]
    assert kinds[-1] == "done", events[-1]
    done: DoneEvent = events[-1]
    segments = [e for e in events if e.type == "segment"]
    margins = [e for e in events if e.type == "margin"]
    assert [s.segment for s in segments] == list(range(done.usage.segments))
    assert sorted(m.segment for m in margins) == list(range(done.usage.segments))
    # Pipelining: margin 0 was submitted before segment 1 finished its prefill.
    at = {(e.type, getattr(e, "segment", None)): t for e, t in zip(events, arrived, strict=True)}
    margin0 = next(e for e in margins if e.segment == 0)
    assert at[("margin", 0)] - margin0.elapsed_s < at[("segment", 1)]
    assert kinds.index("answer") > max(i for i, k in enumerate(kinds) if k == "margin")
    answer = "".join(e.text for e in events if e.type == "answer")
    assert answer.strip() == done.answer and done.answer
    u = done.usage
    assert u.prompt_tokens_computed + u.prompt_tokens_cached == u.prompt_tokens_submitted
    # Only the partial blocks at segment ends are computed twice.
    assert 0 <= u.excess_computed_tokens < u.segments * engine.limits.block_size
    assert u.prompt_tokens_cached > (u.segments - 1) * u.context_tokens // 2


async def test_margins_hit_every_full_context_block(engine, report) -> None:
    builder = PromptBuilder(engine.tokenizer, OPTIONS.prompts)
    plan = plan_document(builder, report, OPTIONS, engine.limits)
    suffix = builder.margin_suffix(QUERY, RelevanceMode.FIRST_TOKEN)
    params = margin_params(builder, engine)
    block = engine.limits.block_size
    context = await engine.open_context(reserve_blocks=200)
    try:
        for segment in plan.segments:
            chunk = plan.encoded.ids[segment.token_start : segment.token_end]
            await context.extend(plan.prefix_ids + chunk if segment.index == 0 else chunk)
            prefix = len(plan.prefix_ids) + segment.token_end
            first = await anext(context.branch(prefix, suffix, params))
            assert first.cost.cached == (prefix // block) * block
            assert first.cost.submitted == prefix + len(suffix)
    finally:
        await context.close()


async def test_margins_over_the_pinned_context_equal_a_fresh_recompute(engine, report) -> None:
    """Margins read the spine's KV; recomputing each margin from scratch gives the same tokens."""
    builder = PromptBuilder(engine.tokenizer, OPTIONS.prompts)
    plan = plan_document(builder, report, OPTIONS, engine.limits)
    suffix = builder.margin_suffix(QUERY, RelevanceMode.FIRST_TOKEN)
    params = margin_params(builder, engine)
    pinned, fresh = [], []
    context = await engine.open_context(reserve_blocks=200)
    try:
        for segment in plan.segments:
            chunk = plan.encoded.ids[segment.token_start : segment.token_end]
            await context.extend(plan.prefix_ids + chunk if segment.index == 0 else chunk)
            prefix = len(plan.prefix_ids) + segment.token_end
            pinned.append(await drain(context.branch(prefix, suffix, params)))
    finally:
        await context.close()
    for segment in plan.segments:
        scratch = await engine.open_context(reserve_blocks=200)  # new salt: no cache to hit
        try:
            prompt = plan.context_ids(segment.token_end) + suffix
            fresh.append(await drain(scratch.generate(prompt, params)))
        finally:
            await scratch.close()
    assert pinned == fresh
    assert any(len(m) > 1 for m in pinned)


async def test_purge_forgets_one_session_and_keeps_another(engine, report) -> None:
    ids = engine.tokenizer.encode_user_text(report).ids[:600]
    params = GenerationParams(RequestKind.MARGIN, 1, frozenset())
    block = engine.limits.block_size
    a = await engine.open_context(reserve_blocks=100)
    b = await engine.open_context(reserve_blocks=100)
    try:
        await a.extend(ids)
        await b.extend(ids)
        probe = [*ids, 13]
        hit_a = await anext(a.generate(probe, params))
        assert hit_a.cost.cached == (len(ids) // block) * block
        salt_a = a.salt
        await a.close()
        # A request that carries the closed session's salt finds nothing of it any more.
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        async for out in engine.engine.generate(
            tokens_input(probe, cache_salt=salt_a), SamplingParams(max_tokens=1), "probe-a"
        ):
            assert out.num_cached_tokens == 0
        # The other live session still hits all its full blocks.
        hit_b = await anext(b.branch(len(ids), [13], params))
        assert hit_b.cost.cached == (len(ids) // block) * block
    finally:
        await a.close()
        await b.close()
    stats = await engine.kv_stats()
    assert stats.cached_blocks == 0 or stats.parked_sessions == 0


async def test_over_long_input_is_refused_and_the_engine_lives(engine, report) -> None:
    too_long = " ".join([report] * 5)  # ~6,000 tokens > the 4,096-token test window
    events = await run(engine, too_long)
    assert [e.type for e in events] == ["error"]
    assert events[0].code == ErrorCode.TOO_LONG.value and "4096" in events[0].message
    # The engine-level guard: pushes that would outgrow the window are refused before vLLM
    # sees them (vLLM itself would die with EngineDeadError).
    ids = engine.tokenizer.encode_user_text(report).ids
    context = await engine.open_context(reserve_blocks=300)
    try:
        await context.extend(ids)
        await context.extend(ids)
        with pytest.raises(WiMError) as info:
            await context.extend(ids * 2)
        assert info.value.code is ErrorCode.TOO_LONG
    finally:
        await context.close()
    assert engine.healthy
    events = await run(engine, report)
    assert events[-1].type == "done"


async def test_eight_concurrent_jobs_complete(engine, report) -> None:
    queries = [
        QUERY,
        "Who replaced Margaret Oyelaran?",
        "How many boats are registered?",
        "When is the harbour office open?",
    ] * 2
    results = await asyncio.gather(*(run(engine, report, q) for q in queries))
    for events in results:
        assert events[-1].type == "done", events[-1]
        assert events[-1].answer


async def test_cancelled_job_returns_its_kv(engine, report) -> None:
    baseline = await wait_for_baseline(engine, (await engine.kv_stats()).free_blocks)
    stream = run_wim(engine, engine.tokenizer, report, QUERY, OPTIONS)
    async for event in stream:
        if event.type == "segment" and event.segment == 2:
            break
    await stream.aclose()
    stats = await wait_for_baseline(engine, baseline.free_blocks)
    assert stats.free_blocks == baseline.free_blocks
    assert stats.parked_sessions == 0
    assert engine.load().sessions == 0


async def test_document_session_answers_queries_from_the_pinned_kv(engine, report) -> None:
    session = await open_document(engine, engine.tokenizer, report, OPTIONS)
    try:
        for query in (QUERY, "Who replaced Margaret Oyelaran?"):
            events = [e async for e in session.query(query)]
            done = events[-1]
            assert done.type == "done", done
            u = done.usage
            # The document is not computed again: beyond the margin instructions and the
            # final prompt, only partial blocks at segment ends are.
            block = engine.limits.block_size
            assert 0 <= u.excess_computed_tokens < u.segments * block
            assert u.prompt_tokens_cached >= (u.context_tokens // block) * block
    finally:
        await session.close()
