"""One WiM context on vLLM: a streaming-input session and its same-salt branches.

The mechanism (measured on vLLM 0.32, see docs/architecture.md):

* A context is one *streaming-input session* (`AsyncLLM.generate` fed by an async generator of
  `StreamingInput`). Each push is sampled with `max_tokens=1`; vLLM discards that token when the
  next input arrives, so the session's KV holds exactly the pushed tokens. While parked between
  pushes the session holds its blocks: they cannot be evicted or preempted.
* A branch (margin, final answer of a document session) is an ordinary request whose prompt is
  `context[:n] + suffix`, carrying the context's server-generated `cache_salt`: prefix caching
  maps every full KV block of `context[:n]` onto the session's physical blocks.
* `conclude` pushes the final prompt into the session itself: the answer reads the whole
  context with zero recompute.
* Closing a context ends the session, then purges its salt's cache entries
  (`WiMScheduler.wim_purge_salt`), so no later request can hit the document's KV.
* Lengths are checked before every push (`request_params.check_window`): a session that
  outgrows `max_model_len` would kill the whole engine, not just the request.
* A context opened for a `StoredDocument` saves its document pushes to the KV store as they
  are computed, and can `restore` a document saved by another engine as its first push
  (`engine/kv_transfer`, docs/kv-store.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from wim_service.engine.admission import KVAdmission
from wim_service.engine.kv_transfer.documents import spine_extra_args
from wim_service.engine.request_params import PRIORITY, check_window, sampling_params
from wim_service.engine.scheduler import SALT_PREFIX
from wim_service.engine.timeline import RequestSpan
from wim_service.wim.backend import (
    NOT_STORED,
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    KVRestore,
    PromptCost,
    RequestKind,
    StoredDocument,
)
from wim_service.wim.errors import ErrorCode, WiMError, logged_failure

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# How long a closing context waits for its last push before aborting it outright, and then
# for the engine to free the blocks of its requests.
CLOSE_TIMEOUT_S = 30.0


def _generation_params(params: GenerationParams) -> SamplingParams:
    """A branch's or conclusion's sampling: the job's stop tokens and first-token choice."""
    return sampling_params(
        params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        first_token_ids=params.first_token_ids,
    )


@dataclass(frozen=True)
class KVReport:
    """A stored context's KV so far, as the engine core counted it."""

    restored_tokens: int
    restore_fallback: str | None
    restore_seconds: float  # the load itself, in the worker
    saved_tokens: int
    saved_bytes: int
    save_failed: str | None


class ContextHost(Protocol):
    """What a context uses of the backend that opened it (`vllm_engine.VLLMBackend`): named
    here so that the context does not import the backend that imports it."""

    engine: AsyncLLM
    limits: EngineLimits
    admission: KVAdmission
    timeline: deque[RequestSpan]

    @property
    def healthy(self) -> bool: ...

    def next_request_id(self, salt: str, kind: str) -> str: ...

    async def purge(self, salt: str) -> dict[str, int]: ...

    async def kv_restorable(
        self, doc: StoredDocument, token_ids: list[int]
    ) -> tuple[int, str | None]: ...


class VLLMContext:
    """One WiM context: a streaming-input session plus same-salt branch requests."""

    def __init__(
        self, backend: ContextHost, reserved_blocks: int, stored: StoredDocument | None = None
    ) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.salt = SALT_PREFIX + secrets.token_hex(16)
        self.stored = stored
        self._restore = False  # the first push loads the stored document
        self._reserved_blocks = reserved_blocks
        # Blocks a query reserved (`reserve_more`) and left while this context was closing:
        # the close gives them back with its own, once the engine freed them (`_end`).
        self._left_to_close = 0
        self._ended = False
        self._more_blocks = 0  # what its running queries hold beyond the reservation
        # The most this context ever had reserved (its reservation plus its queries' extra).
        self.most_reserved_blocks = reserved_blocks
        self._ids: list[int] = []
        self._inputs: asyncio.Queue[Any] = asyncio.Queue()
        self._outputs: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self._spine: asyncio.Task[None] | None = None
        self._concluded = False
        self._closed = False

    @property
    def context_tokens(self) -> int:
        return len(self._ids)

    @contextlib.contextmanager
    def _span(self, kind: str, context_tokens: int) -> Iterator[RequestSpan]:
        span = RequestSpan(self.salt, kind, context_tokens, time.monotonic())
        self.backend.timeline.append(span)
        try:
            yield span
        finally:
            span.ended = time.monotonic()

    # -- the session (spine) ------------------------------------------------------------

    def _check_room(self, total: int, what: str) -> None:
        check_window(total, self.backend.limits.max_model_len, what)

    async def _input_stream(self) -> AsyncGenerator[Any, None]:
        while (item := await self._inputs.get()) is not None:
            yield item

    def _spine_params(self) -> SamplingParams:
        # One token per push, discarded by the next push: the KV holds the pushes only.
        params = sampling_params(1)
        if self.stored is not None:
            # Pushes without their own parameters (the document's) are saved; the first
            # restores if asked. A conclusion's push brings its own, without these.
            params.extra_args = spine_extra_args(self.stored, self.salt, restore=self._restore)
        return params

    async def _run_spine(self) -> None:
        try:
            async for output in self.engine.generate(
                self._input_stream(),
                self._spine_params(),
                self.backend.next_request_id(self.salt, "ctx"),
                priority=PRIORITY[RequestKind.CONTEXT],
            ):
                self._outputs.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to whoever awaits the session next
            self._outputs.put_nowait(exc)
        finally:
            self._outputs.put_nowait(None)

    async def _push(self, token_ids: list[int], params: SamplingParams | None) -> None:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import tokens_input

        if self._closed or self._concluded:
            raise WiMError(ErrorCode.INVALID_INPUT, "the context is closed")
        # The first push carries the salt; vLLM keeps the first chunk's salt for the session.
        salt = self.salt if not self._ids else None
        self._ids.extend(token_ids)
        self._inputs.put_nowait(StreamingInput(tokens_input(token_ids, cache_salt=salt), params))
        if self._spine is None:
            self._spine = asyncio.create_task(self._run_spine())

    async def _next_output(self) -> RequestOutput:
        item = await self._outputs.get()
        if item is None:
            raise WiMError(ErrorCode.ENGINE_ERROR, "the engine ended the context unexpectedly")
        if isinstance(item, BaseException):
            raise logged_failure(
                ErrorCode.ENGINE_ERROR,
                "the engine failed while it held this document",
                item,
                f"context {self.salt[:12]}",
            ) from item
        return item

    async def extend(self, token_ids: list[int]) -> PromptCost:
        # +1: the session samples one token per push before the next push replaces it.
        self._check_room(len(self._ids) + len(token_ids) + 1, "the document")
        with self._span("push", len(self._ids) + len(token_ids)) as span:
            await self._push(token_ids, None)
            while True:
                output = await self._next_output()
                if output.outputs and output.outputs[0].finish_reason is not None:
                    span.output([], finished=True)
                    # The session's own KV is never shared with a cache hit: all pushed tokens
                    # are computed (a resumed push reports the earlier chunks as "cached").
                    return PromptCost(submitted=len(token_ids), cached=0)

    async def restore(self, token_ids: list[int]) -> KVRestore:
        """Push a stored document's `token_ids` as this context's first push, loading its
        saved KV instead of computing it (at most one block and one token are computed).

        The stored manifest is checked first (`VLLMBackend.kv_restorable`); when a restore
        would load nothing (no store, no saved document, another tenant or engine, other
        tokens, the store down), nothing is pushed and `fallback` says why. A document saved
        only in part restores what was saved and computes the rest in the same push.
        """
        if self._ids:
            raise ValueError("a restore must be the context's first push")
        started = time.perf_counter()
        if self.stored is None:
            return NOT_STORED
        tokens, reason = await self.backend.kv_restorable(self.stored, token_ids)
        if not tokens:
            seconds = time.perf_counter() - started
            return KVRestore(0, 0, seconds, reason, holds_document=False)
        self._restore = True
        await self.extend(token_ids)
        report = await self.kv_report()
        restored = report.restored_tokens
        return KVRestore(
            restored_tokens=restored,
            computed_tokens=len(token_ids) - restored,
            seconds=time.perf_counter() - started,
            fallback=None if restored else report.restore_fallback or "block_check",
            holds_document=True,
        )

    async def kv_report(self) -> KVReport:
        """What this context restored and saved so far (zeros unless `stored`)."""
        if self.stored is None:
            return KVReport(0, None, 0.0, 0, 0, None)
        raw = await self.engine.engine_core.call_utility_async("wim_kv_report", self.salt)
        return KVReport(
            restored_tokens=raw["restored_tokens"],
            restore_fallback=raw["restore_reason"],
            restore_seconds=raw["restore_seconds"],
            saved_tokens=raw["saved_tokens"],
            saved_bytes=raw["saved_bytes"],
            save_failed=raw["save_failed"],
        )

    async def conclude(
        self, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        self._check_room(len(self._ids) + len(suffix_ids) + params.max_tokens, "the final prompt")
        with self._span(params.kind.value, len(self._ids)) as span:
            await self._push(suffix_ids, _generation_params(params))
            self._concluded = True
            first, done = True, False
            try:
                while True:
                    output = await self._next_output()
                    completion = output.outputs[0]
                    done = completion.finish_reason is not None
                    token_ids = list(completion.token_ids)
                    span.output(token_ids, done)
                    yield GenerationChunk(
                        token_ids=token_ids,
                        finished=done,
                        cost=PromptCost(len(suffix_ids), 0) if first else None,
                        finish_reason=completion.finish_reason,
                    )
                    first = False
                    if done:
                        return
            finally:
                # Stopped early (stop string, cancellation): abort the session now instead of
                # letting it decode to max_tokens first.
                await self.close(abort=not done)

    # -- branches ------------------------------------------------------------------------

    async def _request(
        self, prompt_ids: list[int], params: GenerationParams, kind: str, context_tokens: int
    ) -> AsyncIterator[GenerationChunk]:
        from vllm.inputs import tokens_input

        if self._closed:
            raise WiMError(ErrorCode.INVALID_INPUT, "the context is closed")
        self._check_room(len(prompt_ids) + params.max_tokens, f"a {params.kind.value} request")
        stream = self.engine.generate(
            tokens_input(prompt_ids, cache_salt=self.salt),
            _generation_params(params),
            self.backend.next_request_id(self.salt, kind),
            priority=PRIORITY[params.kind],
        )
        first = True
        with self._span(params.kind.value, context_tokens) as span:
            try:
                async for output in stream:
                    completion = output.outputs[0]
                    cost = None
                    if first:
                        cost = PromptCost(len(prompt_ids), output.num_cached_tokens or 0)
                        first = False
                    token_ids = list(completion.token_ids)
                    span.output(token_ids, output.finished)
                    yield GenerationChunk(
                        token_ids=token_ids,
                        finished=output.finished,
                        cost=cost,
                        finish_reason=completion.finish_reason,
                    )
            finally:
                await stream.aclose()

    def branch(
        self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        if prefix_tokens > len(self._ids):
            raise ValueError("a branch cannot start past the context's end")
        return self._request(
            self._ids[:prefix_tokens] + suffix_ids, params, "branch", prefix_tokens
        )

    def generate(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        return self._request(prompt_ids, params, "gen", 0)

    @contextlib.asynccontextmanager
    async def reserve_more(self, blocks: int, *, wait: bool = True) -> AsyncIterator[bool]:
        if blocks <= 0:
            yield True
            return
        if wait:
            await self.backend.admission.acquire(blocks, session=False)
        elif not self.backend.admission.acquire_now(blocks):
            yield False
            return
        self._more_blocks += blocks
        self.most_reserved_blocks = max(
            self.most_reserved_blocks, self._reserved_blocks + self._more_blocks
        )
        try:
            if self._closed:  # closed while this waited for room
                raise WiMError(ErrorCode.INVALID_INPUT, "the context is closed")
            yield True
        finally:
            self._more_blocks -= blocks
            if self._closed and not self._ended:
                # The close is aborting the query's requests: their blocks are not free until
                # the engine says so, which the close waits for.
                self._left_to_close += blocks
            else:
                self.backend.admission.release(blocks, session=False)

    # -- end of life ---------------------------------------------------------------------

    async def close(self, *, abort: bool = False) -> None:
        """End the session (frees its KV), purge its cache entries, release its reservation
        (and what a query left in `reserve_more` meanwhile) once the engine freed its blocks.

        Normally the input stream is closed and vLLM ends the session after its current push;
        `abort` (or a push that does not finish in time) aborts the request outright. A caller
        cancelled meanwhile does not cut this short: the rest runs on in the background.
        """
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._end(abort))

    async def _end(self, abort: bool) -> None:
        try:
            if self._spine is not None and not self._spine.done():
                self._inputs.put_nowait(None)
                if not abort:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(CLOSE_TIMEOUT_S):
                            await asyncio.shield(self._spine)
                if not self._spine.done():
                    self._spine.cancel()  # generate() aborts the request on cancellation
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._spine
            if self.backend.healthy:
                await self._purge()
        finally:
            self._ended = True
            self.backend.admission.release(self._reserved_blocks)
            if self._left_to_close:
                self.backend.admission.release(self._left_to_close, session=False)
                self._left_to_close = 0

    async def _purge(self) -> None:
        """Purge the salt and wait until the engine holds none of its blocks.

        Branches of this salt (a query's margins, stopped by the close) may still be finishing
        their abort in the engine core; their blocks show up as busy for a step or more, a
        long prefill step of another job included. The scheduler purges them when they are
        freed (the salt is closed now); the reservation is kept until then, or admission
        control would count blocks as free that the engine still holds.
        """
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while (busy := (await self.backend.purge(self.salt))["busy"]) and self.backend.healthy:
            if time.monotonic() > deadline:
                # An engine that frees nothing for this long is stuck; keeping the reservation
                # forever would not make its blocks free either.
                logger.warning(
                    "context %s: %d blocks still busy %g s after close",
                    self.salt[:12],
                    busy,
                    CLOSE_TIMEOUT_S,
                )
                return
            await asyncio.sleep(0.02)
