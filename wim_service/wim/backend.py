"""What the algorithm needs from an engine: a pinned context that can branch and conclude.

A *context session* holds the document's KV for the life of a job or document session.
`extend` appends tokens to it; `branch` generates from a prefix of it without changing it (a
margin); `conclude` appends a final suffix and generates (the answer, after which the session
takes no more calls); `generate` runs a stand-alone prompt under the session's isolation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from wim_service.wim.tokenizer import Tokenizer


class RequestKind(StrEnum):
    """Why a request exists; engines use it for priorities (margins and answers first)."""

    CONTEXT = "context"
    MARGIN = "margin"
    CLASSIFIER = "classifier"
    ANSWER = "answer"


@dataclass(frozen=True)
class GenerationParams:
    kind: RequestKind
    max_tokens: int
    stop_token_ids: frozenset[int]
    # If set, the first generated token is restricted to these ids (greedy among them).
    first_token_ids: frozenset[int] | None = None


@dataclass(frozen=True)
class PromptCost:
    """How many prompt tokens a request submitted and how many the cache already held."""

    submitted: int
    cached: int

    @property
    def computed(self) -> int:
        return self.submitted - self.cached


@dataclass
class GenerationChunk:
    """New tokens of a generation. `cost` is set on the first chunk."""

    token_ids: list[int]
    finished: bool
    cost: PromptCost | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    block_size: int
    # False for engines that can only work on the context's current end (the reference
    # backend): the orchestrator then runs each margin before the next segment.
    concurrent_branches: bool


@dataclass(frozen=True)
class StoredDocument:
    """A document whose KV an engine saves as it is read and can restore elsewhere: set by
    the service, never from a request."""

    tenant: str
    document: str


@dataclass(frozen=True)
class KVRestore:
    """What restoring a stored document as a context's first push did. `holds_document`: the
    document was pushed (restored, or computed in one pass after a failed block check);
    False: nothing was pushed and the caller reads the document as usual."""

    restored_tokens: int  # loaded from the store, not computed
    computed_tokens: int
    seconds: float
    fallback: str | None  # why nothing was restored (None: it was)
    holds_document: bool


NOT_STORED = KVRestore(0, 0, 0.0, "disabled", holds_document=False)


class ContextSession(Protocol):
    @property
    def context_tokens(self) -> int: ...

    async def extend(self, token_ids: list[int]) -> PromptCost: ...

    async def restore(self, token_ids: list[int]) -> KVRestore:
        """As the first push of a context opened with a `StoredDocument`: push `token_ids`,
        loading their saved KV where the engine has it; pushes nothing when it has none
        (`holds_document` False; an engine without a store answers `NOT_STORED`)."""
        ...

    def branch(
        self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]: ...

    def conclude(
        self, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]: ...

    def generate(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]: ...

    def reserve_more(self, blocks: int, *, wait: bool = True) -> AbstractAsyncContextManager[bool]:
        """Hold `blocks` more KV for this session while the block is entered (a query that
        may need more than the session reserved); yields whether they are held. It may wait,
        or raise `WiMError(OVERLOADED)`; with `wait=False` it holds them only if the engine
        has them free at once and nothing waits for room before them, else yields False."""
        ...

    async def close(self) -> None:
        """End the session: free its KV and purge it from any cache (idempotent). Requests
        still running on it end; a `reserve_more` block still entered gives its blocks back
        no earlier than the close gives the session's."""
        ...


class Backend(Protocol):
    limits: EngineLimits

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's own tokenizer: segments and prompts are cut with it."""
        ...

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> ContextSession:
        """Start an empty session; its first `extend` carries the prompt prefix and segment 0.

        `reserve_blocks` is the session's worst-case KV footprint; an engine may wait for room
        or raise `WiMError(OVERLOADED)`, and raises `WiMError(TOO_LONG)` if it can never fit.
        With `stored`, an engine that keeps KV in a store saves the document as it is read
        (an engine without one ignores it, and its contexts restore nothing).
        """
        ...
