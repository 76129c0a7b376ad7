"""The WiM mechanism on a real vLLM engine with the real default model (fp32)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from wim_service.engine.timeline import RequestSpan
from wim_service.wim.backend import GenerationParams, RequestKind
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import DoneEvent
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import open_document, run_wim
from wim_service.wim.plan import plan_document
from wim_service.wim.prompts import PromptBuilder

pytestmark = pytest.mark.engine

QUERY = "What is the access code for the night gate?"
# Every segment's margin written: these tests are about how the engine runs margins.
OPTIONS = WiMOptions(
    segment_tokens=192, margin_max_tokens=24, answer_max_tokens=24, skip_unmatched_segments=False
)


async def run(engine, document: str, query: str = QUERY, options: WiMOptions = OPTIONS) -> list:
    return [e async for e in run_wim(engine, engine.tokenizer, document, query, options)]


def spans_since(engine, started: float) -> list[RequestSpan]:
    """The engine's own record of the requests submitted since `started` (monotonic)."""
    return [span for span in engine.timeline if span.started >= started]


def outcome(events: list) -> tuple:
    """What a job answered: the answer and every margin with its verdict."""
    assert events[-1].type == "done", events[-1]
    margins = sorted((e.segment, e.text, e.relevant) for e in events if e.type == "margin")
    return events[-1].answer, margins


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
    started = time.monotonic()
    events = [e async for e in run_wim(engine, engine.tokenizer, report, QUERY, OPTIONS)]
    kinds = [e.type for e in events]
    assert kinds[-1] == "done", events[-1]
    done: DoneEvent = events[-1]
    segments = [e for e in events if e.type == "segment"]
    margins = [e for e in events if e.type == "margin"]
    assert [s.segment for s in segments] == list(range(done.usage.segments))
    assert sorted(m.segment for m in margins) == list(range(done.usage.segments))
    # Pipelining, from the engine's own request timeline: margin i is submitted once segment
    # i is in, and is in flight while segment i+1 is pushed.
    spans = spans_since(engine, started)
    assert len({span.context for span in spans}) == 1
    pushes = [span for span in spans if span.kind == "push"]
    margin_of = {span.context_tokens: span for span in spans if span.kind == "margin"}
    assert len(pushes) == len(margin_of) == done.usage.segments >= 3
    for this, following in itertools.pairwise(pushes):
        margin = margin_of[this.context_tokens]
        assert margin.started >= this.ended
        assert margin.started < following.ended and margin.ended > following.started
    assert kinds.index("answer") > max(i for i, k in enumerate(kinds) if k == "margin")
    answer = "".join(e.text for e in events if e.type == "answer")
    assert answer.strip() == done.answer and done.answer
    u = done.usage
    assert u.prompt_tokens_computed + u.prompt_tokens_cached == u.prompt_tokens_submitted
    # Only the partial blocks at segment ends are computed twice.
    assert 0 <= u.excess_computed_tokens < u.segments * engine.limits.block_size
    assert u.prompt_tokens_cached > (u.segments - 1) * u.context_tokens // 2


@pytest.mark.parametrize("no_note", [True, False], ids=["no_note", "notes"])
async def test_an_answer_started_early_is_the_answer_after_the_margins(
    engine, report, short_report, no_note: bool
) -> None:
    """answer_early on the real engine: the answer starts while the last margin is still
    decoding, and the client gets token for token the answer that starts after every margin
    (answer_early off). On the first sections no sentence is near the question: one early
    answer, without notes, stands. On the whole report the running margins are expected to
    copy the code's sentence, so a second early answer over those notes starts beside the
    first; they do, it stands and the first is discarded: no answer starts after them."""
    document = short_report if no_note else report
    started = time.monotonic()
    early = await run(engine, document)
    spans = spans_since(engine, started)
    late = await run(engine, document, options=OPTIONS.model_copy(update={"answer_early": False}))
    assert early[-1].type == late[-1].type == "done", (early[-1], late[-1])
    assert outcome(early) == outcome(late)
    assert early[-1].usage.answer_tokens == late[-1].usage.answer_tokens > 0
    assert (early[-1].usage.discarded_answer_tokens == 0) == no_note
    assert bool(early[-1].notes) is not no_note
    answers = [span for span in spans if span.kind == "answer"]
    assert len(answers) == (1 if no_note else 2)
    last_margin = max((span for span in spans if span.kind == "margin"), key=lambda s: s.started)
    for answer in answers:
        assert answer.started < last_margin.ended
        assert answer.first_output is not None and answer.first_output < last_margin.ended


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


async def test_margins_over_the_pinned_context_equal_a_fresh_recompute(
    engine, short_report
) -> None:
    """Margins read the spine's KV; recomputing each margin from scratch gives the same tokens
    (a few short segments: each recompute reads the whole context up to its segment again)."""
    builder = PromptBuilder(engine.tokenizer, OPTIONS.prompts)
    options = OPTIONS.model_copy(update={"segment_tokens": 128})
    plan = plan_document(builder, short_report, options, engine.limits)
    assert len(plan.segments) >= 3
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
    full_blocks = len(ids) // block
    nothing_left = {"purged": 0, "busy": 0, "stale": 0}
    try:
        await a.extend(ids)
        await b.extend(ids)
        probe = [*ids, 13]
        hit_a = await anext(a.generate(probe, params))
        assert hit_a.cost.cached == full_blocks * block
        cached = (await engine.kv_stats()).cached_blocks
        await a.close()
        # Closing dropped exactly a's full blocks from the prefix cache (vLLM alone keeps the
        # hashes of freed blocks), and nothing of a's salt is left to purge.
        assert cached - (await engine.kv_stats()).cached_blocks == full_blocks
        assert await engine.purge(a.salt) == nothing_left
        # A request that carries the closed session's salt finds nothing of it any more.
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        async for out in engine.engine.generate(
            tokens_input(probe, cache_salt=a.salt), SamplingParams(max_tokens=1), "probe-a"
        ):
            assert out.num_cached_tokens == 0
        # The other live session still hits all its full blocks.
        hit_b = await anext(b.branch(len(ids), [13], params))
        assert hit_b.cost.cached == full_blocks * block
        cached = (await engine.kv_stats()).cached_blocks
        await b.close()
        assert cached - (await engine.kv_stats()).cached_blocks == full_blocks
        assert await engine.purge(b.salt) == nothing_left
    finally:
        await a.close()
        await b.close()


async def test_over_long_input_is_refused_and_the_engine_lives(
    engine, report, short_report
) -> None:
    too_long = " ".join([report] * 5)  # ~6,000 tokens > the 4,096-token test window
    events = await run(engine, too_long)
    assert [e.type for e in events] == ["error"]
    assert events[0].code == ErrorCode.TOO_LONG.value and "4096" in events[0].message
    # The engine-level guard: pushes that would outgrow the window are refused before vLLM
    # sees them (vLLM itself would die with EngineDeadError). The refused push (~3,600
    # tokens) fits the window alone: the guard counts what the context already holds.
    ids = engine.tokenizer.encode_user_text(report).ids
    context = await engine.open_context(reserve_blocks=300)
    try:
        await context.extend(ids)
        with pytest.raises(WiMError) as info:
            await context.extend(ids * 3)
        assert info.value.code is ErrorCode.TOO_LONG
    finally:
        await context.close()
    assert engine.healthy
    events = await run(engine, short_report)
    assert events[-1].type == "done"


@pytest.mark.timeout(1200)
async def test_eight_concurrent_jobs_answer_as_each_alone(engine, short_report) -> None:
    queries = [
        "How many days was the harbour mouth closed this winter?",
        "Who replaced Margaret Oyelaran?",
        "How many boats are registered?",
        "When is the harbour office open?",
    ]
    options = OPTIONS.model_copy(update={"segment_tokens": 96})

    async def job(query: str) -> list:
        return await run(engine, short_report, query, options)

    alone = {query: outcome(await job(query)) for query in queries}
    assert all(answer and len(margins) >= 3 for answer, margins in alone.values())
    together = await asyncio.gather(*(job(query) for query in queries * 2))
    # fp32: sharing engine steps with seven other jobs changes no token of any job.
    for query, events in zip(queries * 2, together, strict=True):
        assert outcome(events) == alone[query], query


async def test_cancelled_job_stops_early_and_leaves_nothing_behind(engine, report) -> None:
    # No stop string and no relevance cut: in a full run every margin runs to its end, so a
    # margin that did not is one the cancellation aborted.
    options = OPTIONS.model_copy(update={"relevance": RelevanceMode.NONE, "margin_stop": []})
    baseline = await wait_for_baseline(engine, (await engine.kv_stats()).free_blocks)
    started = time.monotonic()
    events = []
    stream = run_wim(engine, engine.tokenizer, report, QUERY, options)
    async for event in stream:
        events.append(event)
        if event.type == "segment" and event.segment == 2:
            break
    await stream.aclose()
    spans = spans_since(engine, started)
    # Stopped early: not every segment was pushed, no answer was asked for.
    assert 3 <= sum(span.kind == "push" for span in spans) < events[0].segments
    assert not [span for span in spans if span.kind == RequestKind.ANSWER.value]
    assert [span for span in spans if span.kind == "margin" and not span.finished]
    # Nothing left behind: no request running, every block free again, no reservation.
    assert all(span.ended is not None for span in spans)
    assert engine.engine.get_num_unfinished_requests() == 0
    stats = await wait_for_baseline(engine, baseline.free_blocks)
    assert stats.free_blocks == baseline.free_blocks
    assert stats.parked_sessions == 0
    load = engine.load()
    assert load.sessions == 0 and load.reserved_blocks == 0


async def test_margins_and_answers_run_ahead_of_queued_context_pushes(engine, report) -> None:
    """Priority scheduling: a parked document's margin and answer do not wait behind other
    documents' prefill. In arrival order (FCFS) both would finish after both pushes."""
    ids = engine.tokenizer.encode_user_text(f"{report}\n\n{report}").ids
    document, push = ids[:300], ids[:2100]  # a push is longer than one step's token budget
    parked = await engine.open_context(reserve_blocks=40)
    others = [await engine.open_context(reserve_blocks=80) for _ in range(2)]
    try:
        await parked.extend(document)
        started = time.monotonic()
        pushes = [asyncio.create_task(other.extend(push)) for other in others]
        await asyncio.sleep(0)  # the pushes are submitted first
        branches = [
            drain(parked.branch(len(document), [13], GenerationParams(kind, 1, frozenset())))
            for kind in (RequestKind.MARGIN, RequestKind.ANSWER)
        ]
        await asyncio.gather(*pushes, *branches)
    finally:
        for context in (parked, *others):
            await context.close()
    spans = spans_since(engine, started)
    push_ends = [span.ended for span in spans if span.kind == "push"]
    assert len(push_ends) == 2
    for kind in (RequestKind.MARGIN, RequestKind.ANSWER):
        branch = next(span for span in spans if span.kind == kind.value)
        assert branch.finished
        # At most the push that was already running when the branch arrived finished first.
        assert sum(end < branch.ended for end in push_ends) <= 1, kind


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
