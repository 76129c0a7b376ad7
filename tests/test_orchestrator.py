"""The WiM loop against a scripted fake engine: relevance, stops, errors, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from wim_service.wim.backend import (
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    PromptCost,
    RequestKind,
)
from wim_service.wim.errors import ErrorCode
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import run_wim

Script = Callable[[GenerationParams, int], str]


@dataclass
class FakeContext:
    backend: FakeBackend
    ids: list[int] = field(default_factory=list)
    closed: bool = False

    @property
    def context_tokens(self) -> int:
        return len(self.ids)

    async def extend(self, token_ids: list[int]) -> PromptCost:
        self.backend.log.append(("extend-start", len(self.ids)))
        await asyncio.sleep(0.02)
        self.ids.extend(token_ids)
        self.backend.log.append(("extend-done", len(self.ids)))
        return PromptCost(len(token_ids), 0)

    async def _stream(
        self, params: GenerationParams, prefix: int, prompt: int
    ) -> AsyncIterator[GenerationChunk]:
        tag = (params.kind.value, prefix)
        self.backend.log.append(("start", *tag))
        ids = self.backend.tokenizer.encode_user_text(self.backend.script(params, prefix)).ids
        sent = 0
        try:
            for i, token in enumerate(ids):
                await asyncio.sleep(0.001)
                sent += 1
                yield GenerationChunk(
                    [token], i == len(ids) - 1, PromptCost(prompt, prefix) if i == 0 else None
                )
        finally:
            self.backend.log.append(("end", *tag, sent, len(ids)))

    def branch(self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams):
        if self.backend.fail_on == params.kind:
            raise RuntimeError("engine exploded")
        return self._stream(params, prefix_tokens, prefix_tokens + len(suffix_ids))

    def conclude(self, suffix_ids: list[int], params: GenerationParams):
        return self.branch(len(self.ids), suffix_ids, params)

    def generate(self, prompt_ids: list[int], params: GenerationParams):
        return self._stream(params, 0, len(prompt_ids))

    async def close(self) -> None:
        self.closed = True


@dataclass
class FakeBackend:
    tokenizer: object
    script: Script
    concurrent: bool = True
    fail_on: RequestKind | None = None
    log: list[tuple] = field(default_factory=list)
    contexts: list[FakeContext] = field(default_factory=list)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(2048, 32, self.concurrent)

    async def open_context(self, *, reserve_blocks: int) -> FakeContext:
        assert reserve_blocks > 0
        self.contexts.append(FakeContext(self))
        return self.contexts[-1]


DOC = " ".join(f"Sentence {i} is about the harbour and its boats." for i in range(60))


def options(**kw) -> WiMOptions:
    return WiMOptions(segment_tokens=128, margin_max_tokens=32, answer_max_tokens=32, **kw)


async def collect(backend, query="Where is the gate?", opts=None, **kw) -> list:
    return [
        e async for e in run_wim(backend, backend.tokenizer, DOC, query, opts or options(), **kw)
    ]


async def test_first_token_no_drops_the_margin_at_its_first_token(tokenizer) -> None:
    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.MARGIN:
            return "YES: The gate is on Salt Lane." if prefix % 2 else "NO, nothing here at all."
        return "On Salt Lane."

    backend = FakeBackend(tokenizer, script)
    events = await collect(backend)
    margins = [e for e in events if e.type == "margin"]
    assert margins and events[-1].type == "done"
    for m in margins:
        if m.relevant:
            assert m.text == "The gate is on Salt Lane."
        else:
            assert m.text == ""
    # Every NO margin was cut after exactly one token.
    ends = [e for e in backend.log if e[0] == "end" and e[1] == "margin"]
    dropped = [e for e in ends if e[3] == 1]
    assert len(dropped) == sum(not m.relevant for m in margins) > 0
    assert events[-1].answer == "On Salt Lane."
    assert backend.contexts[0].closed


async def test_stop_string_ends_a_margin_early(tokenizer) -> None:
    def script(params: GenerationParams, prefix: int) -> str:
        return (
            "Fact one.\n\nIgnored rambling that goes on."
            if params.kind is RequestKind.MARGIN
            else "A."
        )

    backend = FakeBackend(tokenizer, script)
    events = await collect(backend, opts=options(relevance=RelevanceMode.NONE))
    margins = [e for e in events if e.type == "margin"]
    assert all(m.text == "Fact one." and m.relevant for m in margins)
    ends = [e for e in backend.log if e[0] == "end" and e[1] == "margin"]
    assert all(sent < total for _, _, _, sent, total in ends)


async def test_classifier_mode_asks_a_separate_turn(tokenizer) -> None:
    verdicts = iter(["YES", "NO"] * 50)

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.CLASSIFIER:
            assert params.max_tokens == 1 and params.first_token_ids
            return next(verdicts)
        return "Some fact." if params.kind is RequestKind.MARGIN else "Answer."

    backend = FakeBackend(tokenizer, script, concurrent=False)
    events = await collect(backend, opts=options(relevance=RelevanceMode.CLASSIFIER))
    margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
    assert [m.relevant for m in margins] == [i % 2 == 0 for i in range(len(margins))]
    assert events[-1].usage.margin_tokens > 0


async def test_pipelined_submits_margin_i_with_segment_i_plus_1(tokenizer) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "NO")
    await collect(backend)
    log = backend.log
    first_margin = log.index(("start", "margin", next(e[2] for e in log if e[0] == "start")))
    second_extend_done = [i for i, e in enumerate(log) if e[0] == "extend-done"][1]
    assert first_margin < second_extend_done

    sequential = FakeBackend(tokenizer, lambda p, prefix: "NO")
    await collect(sequential, pipelined=False)
    order = [e[0] for e in sequential.log if e[0] in ("extend-start", "end")]
    # extend, margin, extend, margin, ...: each margin ends before the next segment starts.
    assert order[:4] == ["extend-start", "end", "extend-start", "end"]


async def test_engine_failure_becomes_an_error_event_and_closes(tokenizer) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES x", fail_on=RequestKind.ANSWER)
    events = await collect(backend)
    assert events[-1].type == "error" and events[-1].code == ErrorCode.ENGINE_ERROR.value
    assert "engine exploded" in events[-1].message
    assert backend.contexts[0].closed


async def test_consumer_leaving_cancels_and_closes(tokenizer) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES " + "word " * 30)
    stream = run_wim(backend, tokenizer, DOC, "q?", options())
    async for event in stream:
        if event.type == "segment" and event.segment == 1:
            break
    await stream.aclose()
    await asyncio.sleep(0.05)
    assert backend.contexts[0].closed


@pytest.mark.parametrize(
    ("document", "query", "code"),
    [
        ("   ", "q?", ErrorCode.INVALID_INPUT),
        (DOC, " ", ErrorCode.INVALID_INPUT),
        (DOC * 5, "q?", ErrorCode.TOO_LONG),
    ],
)
async def test_bad_input_is_refused_before_engine_work(tokenizer, document, query, code) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "x")
    events = [e async for e in run_wim(backend, tokenizer, document, query, options())]
    assert [e.type for e in events] == ["error"] and events[0].code == code.value
    assert backend.contexts == []
