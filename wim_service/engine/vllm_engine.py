"""WiM contexts on one vLLM `AsyncLLM` (V1 engine, vLLM 0.32).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wim_service.engine import kv_memory
from wim_service.engine.admission import AdmissionLoad, KVAdmission
from wim_service.engine.config import EngineConfig
from wim_service.engine.request_params import (
    PRIORITY,
    check_window,
    plain_request_blocks,
    sampling_params,
)
from wim_service.engine.scheduler import SALT_PREFIX
from wim_service.wim.backend import (
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    PromptCost,
    RequestKind,
)
from wim_service.wim.errors import ErrorCode, WiMError, logged_failure
from wim_service.wim.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# How long a closing context waits for its last push before aborting it outright, and then
# for the engine to free the blocks of its requests.
CLOSE_TIMEOUT_S = 30.0
# Request spans kept in `VLLMBackend.timeline` (the most recent ones).
TIMELINE_SPANS = 4096


@dataclass
class RequestSpan:
    """One engine request of a context as this layer saw it: what overlapped, what was cut.

    `kind` is "push" (a context input) or the `RequestKind` of a branch, stand-alone turn or
    conclusion. `context_tokens` is, for a push, the context's length after it; for a branch,
    the context prefix it reads; for a conclusion, the whole context; 0 for a stand-alone turn.
    Times are `time.monotonic()`. A span that `ended` without `finished` was abandoned (aborted,
    or its caller stopped waiting).
    """

    context: str  # the context's cache salt
    kind: str
    context_tokens: int
    started: float
    first_output: float | None = None
    ended: float | None = None
    finished: bool = False
    output_tokens: int = 0

    def output(self, token_ids: list[int], finished: bool) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()
        self.output_tokens += len(token_ids)
        self.finished = finished


@dataclass(frozen=True)
class KVStats:
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    parked_sessions: int


def threads_bind(setting: str, rank: int = 0) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` value for an EngineConfig.cpu_threads_bind setting."""
    cores = sorted(os.sched_getaffinity(0))
    if setting == "all":
        return ",".join(str(c) for c in cores)
    if setting == "rank":
        return str(cores[rank % len(cores)])
    return setting


def configure_process_env(config: EngineConfig, rank: int = 0) -> None:
    """Environment vLLM reads at engine start (it must be set before the engine spawns)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(config.cpu_threads_bind, rank)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's own usage-stats reporting would try the network.
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    # How long vLLM's shutdown waits for a process to end before it kills it, at each level
    # (the front end for its EngineCore, the EngineCore for its workers). Its 5 s default,
    # nested, was the whole of a stopped command's exit time: an EngineCore takes longer than
    # that to end on SIGTERM, and defers it altogether while the model loads.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "2")


@dataclass(frozen=True)
class Completion:
    """One ordinary (salt-free) request's output and what it cost."""

    text: str
    token_ids: list[int]
    cost: PromptCost
    seconds: float


@dataclass(frozen=True)
class CompletionChunk:
    """New output of a streamed ordinary request. `cost` is set on the first chunk."""

    text: str  # decoded by vLLM (stop strings cut, incomplete characters held back)
    token_ids: list[int]
    cost: PromptCost | None
    finish_reason: str | None


class VLLMBackend:
    """Implements `wim.backend.Backend` over one `AsyncLLM` shared by many jobs."""

    def __init__(self, engine: AsyncLLM, config: EngineConfig, tokenizer: HFTokenizer) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        cache = engine.vllm_config.cache_config
        self.limits = EngineLimits(
            max_model_len=engine.model_config.max_model_len,
            block_size=cache.block_size,
            concurrent_branches=True,
        )
        # vLLM's block 0 is a null block that never holds KV.
        capacity = (cache.num_gpu_blocks or 0) - 1
        self.admission = KVAdmission(capacity, config.max_sessions, config.admission_timeout_s)
        self._ids = itertools.count()
        # Every context request's span, for tests and debugging (a deque append per request).
        self.timeline: deque[RequestSpan] = deque(maxlen=TIMELINE_SPANS)

    @classmethod
    def start(cls, config: EngineConfig, *, rank: int = 0) -> VLLMBackend:
        """Build the engine (spawns the engine-core process: call under `__main__` guards).

        `rank` is this engine's index among the engines of one machine (thread binding).
        """
        from wim_service.assets.default_model import default_model_dir
        from wim_service.assets.paths import force_offline

        force_offline()
        configure_process_env(config, rank)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        model = config.model or str(default_model_dir())
        args = AsyncEngineArgs(
            model=model,
            # On a GPU, vLLM's "auto" (the model's dtype) stays.
            dtype=config.cpu_dtype() if current_platform.is_cpu() else config.dtype,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            scheduling_policy="priority",
            scheduler_cls="wim_service.engine.scheduler.WiMScheduler",
            worker_extension_cls=kv_memory.EXTENSION,
            logits_processors=["wim_service.engine.first_token:FirstTokenChoice"],
            kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30),
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            disable_log_stats=False,
        )
        engine = AsyncLLM.from_engine_args(args)
        tokenizer = HFTokenizer(model, template_special_tokens=config.template_special_tokens)
        return cls(engine, config, tokenizer)

    def shutdown(self) -> None:
        self.engine.shutdown()
        # AsyncLLM.__del__ shuts down again; at interpreter exit that raises from half-torn
        # module globals, so drop the engine while the interpreter is whole.
        del self.engine
        gc.collect()

    @property
    def healthy(self) -> bool:
        return not self.engine.errored

    def next_request_id(self, salt: str, kind: str) -> str:
        return f"{salt}-{kind}-{next(self._ids)}"

    async def open_context(self, *, reserve_blocks: int) -> VLLMContext:
        if not self.healthy:
            raise WiMError(ErrorCode.ENGINE_ERROR, "the engine is not running")
        await self.admission.acquire(reserve_blocks)
        return VLLMContext(self, reserve_blocks)

    def load(self) -> AdmissionLoad:
        return self.admission.load()

    async def kv_stats(self) -> KVStats:
        stats = await self.engine.engine_core.call_utility_async("wim_kv_stats")
        return KVStats(
            free_blocks=stats["free_blocks"],
            total_blocks=stats["total_blocks"],
            cached_blocks=stats["cached_blocks"],
            parked_sessions=stats["parked_sessions"],
        )

    async def peak_blocks(self, salt: str) -> int:
        """The most KV blocks the requests of `salt` held at once."""
        return await self.engine.engine_core.call_utility_async("wim_peak_blocks", salt)

    async def purge(self, salt: str) -> dict[str, int]:
        """Purge `salt`'s KV from the prefix cache and close it: its blocks still busy are
        purged when they are freed. Zeroes the blocks if `config.zero_purged_blocks`."""
        return await self.engine.engine_core.call_utility_async(
            "wim_purge_salt", salt, self.config.zero_purged_blocks
        )

    async def salt_blocks(self, salt: str) -> list[int]:
        """The KV blocks `salt`'s live requests hold, and those recorded for its purge."""
        return await self.engine.engine_core.call_utility_async("wim_salt_blocks", salt)

    async def block_magnitudes(self, block_ids: list[int]) -> list[float]:
        """Each block's largest absolute KV value, read in the (first) worker."""
        results = await self.engine.collective_rpc(kv_memory.BLOCK_MAGNITUDES, args=(block_ids,))
        return results[0]

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        exact_tokens: bool = False,
        cache_salt: str | None = None,
    ) -> Completion:
        """One ordinary greedy request outside any WiM context (plain long context, RAG).

        It carries no cache salt, so it may hit prefix blocks of other ordinary requests (the
        shared system prompt); `cost` says how many. A fresh `cache_salt` rules such hits out.
        `exact_tokens` forces `max_tokens` tokens, for timing comparisons at a fixed answer
        length.
        """
        started = time.perf_counter()
        token_ids: list[int] = []
        cost = None
        async for chunk in self.stream_complete(
            prompt_ids,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            exact_tokens=exact_tokens,
            cache_salt=cache_salt,
        ):
            token_ids += chunk.token_ids
            cost = cost or chunk.cost
        assert cost is not None
        return Completion(
            text=self.tokenizer.decode(token_ids).strip(),
            token_ids=token_ids,
            cost=cost,
            seconds=time.perf_counter() - started,
        )

    async def stream_complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        stop: Sequence[str] = (),
        exact_tokens: bool = False,
        cache_salt: str | None = None,
        reserve: bool = False,
    ) -> AsyncIterator[CompletionChunk]:
        """`complete`, streamed as it decodes. `stop` strings end the text (excluded).

        `reserve` holds the request's worst-case KV blocks in admission control while it runs
        (waiting for room like a WiM job): a service request beside parked WiM contexts must
        not take blocks their reservations count on. Leaving early aborts the request.
        """
        from vllm.inputs import tokens_input

        limits = self.limits
        check_window(len(prompt_ids) + max_tokens, limits.max_model_len, "the prompt and answer")
        params = sampling_params(
            max_tokens,
            stop_token_ids=self.tokenizer.eos_token_ids | stop_token_ids,
            stop=stop,
            exact_tokens=exact_tokens,
            detokenize=True,  # the text is the answer: stop strings and held-back characters
        )
        stream = self.engine.generate(  # starts on the first iteration
            tokens_input(prompt_ids, cache_salt=cache_salt),
            params,
            self.next_request_id("plain", "complete"),
            priority=PRIORITY[RequestKind.ANSWER],
        )
        worst_case = plain_request_blocks(len(prompt_ids), max_tokens, limits.block_size)
        blocks = worst_case if reserve else 0
        if blocks:
            await self.admission.acquire(blocks, session=False)
        first = True
        try:
            async for output in stream:
                completion = output.outputs[0]
                yield CompletionChunk(
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    cost=PromptCost(len(prompt_ids), output.num_cached_tokens or 0)
                    if first
                    else None,
                    finish_reason=completion.finish_reason,
                )
                first = False
        finally:
            await stream.aclose()
            if blocks:
                self.admission.release(blocks, session=False)


def _generation_params(params: GenerationParams) -> SamplingParams:
    """A branch's or conclusion's sampling: the job's stop tokens and first-token choice."""
    return sampling_params(
        params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        first_token_ids=params.first_token_ids,
    )


class VLLMContext:
    """One WiM context: a streaming-input session plus same-salt branch requests."""

    def __init__(self, backend: VLLMBackend, reserved_blocks: int) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.salt = SALT_PREFIX + secrets.token_hex(16)
        self._reserved_blocks = reserved_blocks
        # Blocks a query reserved (`reserve_more`) and left while this context was closing:
        # the close gives them back with its own, once the engine freed them (`_end`).
        self._left_to_close = 0
        self._ended = False
        # The most this context ever had reserved (its reservation plus a query's extra).
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

    async def _run_spine(self) -> None:
        try:
            async for output in self.engine.generate(
                self._input_stream(),
                # One token per push, discarded by the next push: the KV holds the pushes only.
                sampling_params(1),
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
    async def reserve_more(self, blocks: int) -> AsyncIterator[None]:
        if blocks <= 0:
            yield
            return
        await self.backend.admission.acquire(blocks, session=False)
        self.most_reserved_blocks = max(self.most_reserved_blocks, self._reserved_blocks + blocks)
        try:
            if self._closed:  # closed while this waited for room
                raise WiMError(ErrorCode.INVALID_INPUT, "the context is closed")
            yield
        finally:
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
                        await asyncio.wait_for(asyncio.shield(self._spine), CLOSE_TIMEOUT_S)
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
