"""The capacity model (`wim.capacity`): what a job reserves covers what the engine allocates.

For many option combinations, drawn at random with a fixed seed plus the extremes, a real
engine runs the job and reports the most KV blocks the job's requests held at once (the
scheduler tracks it per cache salt); that peak must never exceed the job's reservation.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from wim_service.wim.backend import EngineLimits
from wim_service.wim.capacity import JobShape, largest_document
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import open_document, run_wim
from wim_service.wim.plan import plan_document
from wim_service.wim.prompts import PromptBuilder

QUERY = "What is the access code for the night gate?"
LONG_QUERY = QUERY + " Please consider " + "every gate, door, lock and code " * 30


def _combinations() -> list[dict[str, Any]]:
    rng = random.Random(7)
    extremes = [
        {"relevance": "classifier", "margin_max_tokens": 200, "answer_max_tokens": 300},
        {"relevance": "none", "segment_tokens": 32, "margin_max_tokens": 64},
        {"relevance": "first_token", "segment_tokens": 256, "answer_max_tokens": 1},
    ]
    drawn = [
        {
            "relevance": rng.choice([m.value for m in RelevanceMode]),
            "segment_tokens": rng.choice([32, 64, 96, 128, 200]),
            "margin_max_tokens": rng.randint(1, 160),
            "answer_max_tokens": rng.randint(1, 200),
            "margin_stop": rng.choice([["\n\n"], []]),
        }
        for _ in range(5)
    ]
    return extremes + drawn


class _Spy:
    """Records the contexts an engine opens."""

    def __init__(self, engine: Any) -> None:
        self.contexts: list[Any] = []
        self._open = engine.open_context

    async def open_context(self, *, reserve_blocks: int, stored: Any = None) -> Any:
        context = await self._open(reserve_blocks=reserve_blocks, stored=stored)
        self.contexts.append(context)
        return context


async def _assert_within_reservation(engine: Any, spy: _Spy) -> None:
    assert spy.contexts
    for context in spy.contexts:
        peak = await engine.peak_blocks(context.salt)
        assert peak > 0, "the engine tracked no blocks for the job"
        assert peak <= context.most_reserved_blocks, (peak, context.most_reserved_blocks)
    spy.contexts.clear()


@pytest.mark.engine
async def test_one_shot_jobs_stay_within_their_reservation(engine, short_report, monkeypatch):
    spy = _Spy(engine)
    monkeypatch.setattr(engine, "open_context", spy.open_context)

    async def job(options: dict[str, Any], query: str) -> None:
        wim = WiMOptions(**options)
        events = [e async for e in run_wim(engine, engine.tokenizer, short_report, query, wim)]
        assert events[-1].type == "done", (options, events[-1])

    # All at once, as a replica serves them: the engine batches them (and admission queues
    # what does not fit); each job's peak is tracked under its own cache salt.
    await asyncio.gather(*(job(o, q) for o in _combinations() for q in (QUERY, LONG_QUERY)))
    assert len(spy.contexts) == 2 * len(_combinations())
    await _assert_within_reservation(engine, spy)
    assert engine.load().reserved_blocks == 0


@pytest.mark.engine
async def test_session_queries_larger_than_reserved_take_more_and_give_it_back(
    engine, short_report, monkeypatch
):
    spy = _Spy(engine)
    monkeypatch.setattr(engine, "open_context", spy.open_context)
    session = await open_document(
        engine, engine.tokenizer, short_report, WiMOptions(segment_tokens=64)
    )
    (context,) = spy.contexts
    reserved = engine.load().reserved_blocks
    try:
        big = WiMOptions(segment_tokens=64, margin_max_tokens=300, answer_max_tokens=400)
        for query, options in ((QUERY, None), (LONG_QUERY, big)):
            events = [e async for e in session.query(query, options)]
            assert events[-1].type == "done", events[-1]
            peak = await engine.peak_blocks(context.salt)
            assert peak <= context.most_reserved_blocks, (peak, context.most_reserved_blocks)
            # The extra reservation of a large query ends with it.
            assert engine.load().reserved_blocks == reserved
        assert context.most_reserved_blocks > reserved  # the large query did reserve more
    finally:
        await session.close()
    assert engine.load().reserved_blocks == 0


@pytest.mark.engine
@pytest.mark.parametrize("kept_free", [False, True], ids=["kv_free", "kv_kept_free"])
async def test_session_queries_at_once_run_side_by_side_as_each_alone(
    engine, short_report, monkeypatch, kept_free: bool
):
    """Three queries at once on one document session: the two the session's own blocks do
    not hold reserve blocks of their own and run beside it, within the reservations, and
    each answers exactly as it does alone (float32). With the engine's KV kept free of
    side-by-side queries (`side_by_side_kv_reserve`, here all of it), they take turns in the
    session's own blocks and answer the same."""
    if kept_free:
        monkeypatch.setattr(engine.admission, "keep_free_blocks", engine.admission.capacity_blocks)
    spy = _Spy(engine)
    monkeypatch.setattr(engine, "open_context", spy.open_context)
    options = WiMOptions(segment_tokens=64)
    session = await open_document(engine, engine.tokenizer, short_report, options)
    (context,) = spy.contexts
    reserved = engine.load().reserved_blocks
    queries = (QUERY, "Who keeps the harbour's boats?", "When does the day gate open?")

    async def answer(query: str) -> tuple[str, list[int]]:
        events = [e async for e in session.query(query)]
        assert events[-1].type == "done", events[-1]
        return events[-1].answer, events[-1].notes

    try:
        alone = [await answer(query) for query in queries]
        assert context.most_reserved_blocks == reserved  # one at a time: the session's own
        together = await asyncio.gather(*(answer(query) for query in queries))
        assert list(together) == alone
        # The first ran in the session's blocks; the other two, beside it at the same time,
        # each in the blocks its own shape needs (none beside it with the KV kept free).
        limits = engine.limits
        own = [
            session.plan.shape(session.builder, options, q).query_blocks(
                limits.block_size, limits.max_model_len
            )
            for q in queries[1:]
        ]
        assert context.most_reserved_blocks == reserved + (0 if kept_free else sum(own))
        peak = await engine.peak_blocks(context.salt)
        assert peak <= context.most_reserved_blocks, (peak, context.most_reserved_blocks)
        assert engine.load().reserved_blocks == reserved
    finally:
        await session.close()
    assert engine.load().reserved_blocks == 0


def test_the_window_check_ignores_notes_but_counts_margins_and_answers(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, WiMOptions().prompts)
    options = WiMOptions(margin_max_tokens=48, answer_max_tokens=64)
    limits = EngineLimits(4096, 32, True)
    longest = largest_document(builder, options, limits.max_model_len, QUERY)
    text = "The gate code is 4417. " * 2000
    ids = tokenizer.encode_user_text(text).ids
    fitting = tokenizer.decode(ids[: longest - 8])
    plan = plan_document(builder, fitting, options, limits)
    shape = plan.shape(builder, options, QUERY)
    shape.check_window(limits.max_model_len)  # fits although every margin cannot be noted
    assert shape.context_tokens + shape.notes_tokens > limits.max_model_len
    with pytest.raises(Exception, match="context window"):
        JobShape.of(
            builder,
            context_tokens=shape.context_tokens,
            document_tokens=shape.document_tokens,
            segments=shape.segments,
            options=WiMOptions(margin_max_tokens=48, answer_max_tokens=200),
            query=QUERY,
        ).check_window(limits.max_model_len)
