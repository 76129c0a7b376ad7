"""A scripted fake engine for the WiM loop's tests: no vLLM, no model weights.

`FakeBackend` implements the algorithm's `Backend` protocol (`wim/backend.py`) and its
`FakeContext` the `ContextSession` protocol: each generation answers what the test's `script`
says for the request's kind and prefix, tokenized by the real tokenizer. Every push and request
goes to `backend.log` in order, so a test reads the job's timeline from it; a gate stalls
generations, `fail_on` makes requests of one kind fail, and `saved` is a KV store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from wim_service.wim.backend import (
    Backend,
    ContextSession,
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    KVRestore,
    PromptCost,
    RequestKind,
    StoredDocument,
)
from wim_service.wim.options import WiMOptions
from wim_service.wim.tokenizer import Tokenizer

Script = Callable[[GenerationParams, int], str]


@dataclass(frozen=True)
class Request:
    """A generation request as the engine got it: the context prefix it reads, then `suffix`."""

    kind: RequestKind
    prefix: int
    suffix: list[int]
    params: GenerationParams


# What a failing engine's exception may say: nothing a client should see.
ENGINE_TRACEBACK = 'Traceback (most recent call last):\n  File "/srv/wim/engine.py", line 1'


def _open_gate() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


# The fake engine's clock counts turns of the event loop, not seconds: a push lasts as long
# as PUSH_STEPS tokens of every running generation, whatever the machine's load. (With
# wall-clock sleeps, how many margin tokens fit in a push changed with the load, and so did
# which early answers started: a test failed one run in three on a busy machine.)
PUSH_STEPS = 20


async def steps(turns: int) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


@dataclass
class FakeContext:
    """Logs every push and request to `backend.log`: the log's order is the job's timeline."""

    backend: FakeBackend
    ids: list[int] = field(default_factory=list)
    closed: bool = False
    reserved_blocks: int = 0
    extra_reserved: list[int] = field(default_factory=list)  # reserve_more calls
    concluded: int = 0

    stored: StoredDocument | None = None  # its pushes are saved in `backend.saved`

    @property
    def context_tokens(self) -> int:
        return len(self.ids)

    async def extend(self, token_ids: list[int]) -> PromptCost:
        self.backend.log.append(("extend-start", len(self.ids)))
        await steps(PUSH_STEPS)
        self.ids.extend(token_ids)
        self.backend.log.append(("extend-done", len(self.ids)))
        if self.stored is not None:
            self.backend.saved[self.stored] = list(self.ids)
        return PromptCost(len(token_ids), 0)

    async def restore(self, token_ids: list[int]) -> KVRestore:
        """Loads what a context of the same key saved, if it is these very tokens."""
        assert not self.ids, "a restore is the first push"
        saved = None if self.stored is None else self.backend.saved.get(self.stored)
        if saved != token_ids:
            fallback = (
                "disabled" if self.stored is None else "missing" if saved is None else "digest"
            )
            return KVRestore(0, 0, 0.0, fallback, holds_document=False)
        self.ids = list(token_ids)
        self.backend.log.append(("restored", len(self.ids)))
        return KVRestore(len(token_ids), 0, 0.0, None, holds_document=True)

    async def _stream(
        self, params: GenerationParams, prefix: int, prompt: int
    ) -> AsyncIterator[GenerationChunk]:
        tag = (params.kind.value, prefix)
        self.backend.log.append(("start", *tag))
        ids = self.backend.tokenizer.encode_user_text(self.backend.script(params, prefix)).ids
        sent = 0
        try:
            for i, token in enumerate(ids):
                await steps(1)
                await self.backend.gate.wait()
                sent += 1
                yield GenerationChunk(
                    [token], i == len(ids) - 1, PromptCost(prompt, prefix) if i == 0 else None
                )
        finally:
            self.backend.log.append(("end", *tag, sent, len(ids)))

    def branch(
        self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        if self.backend.fail_on == params.kind:
            raise RuntimeError(ENGINE_TRACEBACK)
        self.backend.requests.append(Request(params.kind, prefix_tokens, suffix_ids, params))
        return self._stream(params, prefix_tokens, prefix_tokens + len(suffix_ids))

    def conclude(
        self, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        self.concluded += 1
        return self.branch(len(self.ids), suffix_ids, params)

    def generate(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        self.backend.requests.append(Request(params.kind, 0, prompt_ids, params))
        return self._stream(params, 0, len(prompt_ids))

    @contextlib.asynccontextmanager
    async def reserve_more(self, blocks: int, *, wait: bool = True) -> AsyncIterator[bool]:
        capacity = self.backend.capacity_blocks
        if not wait and capacity is not None and self.backend.reserved_blocks + blocks > capacity:
            yield False
            return
        self.backend.reserved_blocks += blocks
        self.extra_reserved.append(blocks)
        try:
            yield True
        finally:
            self.backend.reserved_blocks -= blocks

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.reserved_blocks -= self.reserved_blocks


@dataclass
class FakeBackend:
    tokenizer: Tokenizer
    script: Script
    concurrent: bool = True
    fail_on: RequestKind | None = None
    log: list[tuple[Any, ...]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    contexts: list[FakeContext] = field(default_factory=list)
    # Generations emit tokens only while the gate is open (a closed gate stalls them).
    gate: asyncio.Event = field(default_factory=_open_gate)
    reserved_blocks: int = 0  # what open contexts hold, like an engine's admission control
    capacity_blocks: int | None = None  # what `reserve_more(wait=False)` may fill (None: all)
    # A KV store: what each stored document's context pushed (`FakeContext.stored`).
    saved: dict[StoredDocument, list[int]] = field(default_factory=dict)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(2048, 32, self.concurrent)

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> FakeContext:
        assert reserve_blocks > 0
        self.reserved_blocks += reserve_blocks
        self.contexts.append(FakeContext(self, reserved_blocks=reserve_blocks, stored=stored))
        return self.contexts[-1]


DOC = " ".join(f"Sentence {i} is about the harbour and its boats." for i in range(60))


def options(**kw: Any) -> WiMOptions:
    # The loop's mechanics, not the query-overlap filter: every margin's note may be kept.
    kw.setdefault("note_min_query_overlap", 0.0)
    return WiMOptions(segment_tokens=128, margin_max_tokens=32, answer_max_tokens=32, **kw)


class RecordingEngineContext:
    """A real engine's `ContextSession`, with the suffix of every answer request recorded in
    `finals` (appended to the context, or a branch: an answer started early)."""

    def __init__(self, context: ContextSession, finals: list[list[int]]) -> None:
        self.context, self.finals = context, finals

    @property
    def context_tokens(self) -> int:
        return self.context.context_tokens

    async def extend(self, token_ids: list[int]) -> PromptCost:
        return await self.context.extend(token_ids)

    async def restore(self, token_ids: list[int]) -> KVRestore:
        return await self.context.restore(token_ids)

    def branch(
        self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        if params.kind is RequestKind.ANSWER:
            self.finals.append(list(suffix_ids))
        return self.context.branch(prefix_tokens, suffix_ids, params)

    def conclude(
        self, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        self.finals.append(list(suffix_ids))
        return self.context.conclude(suffix_ids, params)

    def generate(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        return self.context.generate(prompt_ids, params)

    def reserve_more(self, blocks: int, *, wait: bool = True) -> AbstractAsyncContextManager[bool]:
        return self.context.reserve_more(blocks, wait=wait)

    async def close(self) -> None:
        await self.context.close()


class RecordingEngine:
    """A real engine's `Backend` whose contexts record their answer requests' suffixes in
    `finals`, the last answer's last."""

    def __init__(self, engine: Backend) -> None:
        self.engine = engine
        self.limits = engine.limits
        self.finals: list[list[int]] = []

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> ContextSession:
        context = await self.engine.open_context(reserve_blocks=reserve_blocks, stored=stored)
        return RecordingEngineContext(context, self.finals)
