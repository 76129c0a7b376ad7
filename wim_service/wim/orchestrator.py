"""The WiM loop: read a document segment by segment, write margins, answer.

`WiMSession` holds one document pinned in one engine context. A one-shot job (`run_wim`) reads
the document with the query known, so margin i is submitted together with the push of segment
i+1 and runs in the same engine steps; a document session (`open_document`) reads the document
once and then answers many queries, each as branches over the pinned context.

Everything a job produces is an event (`wim_service.wim.events`); errors end the stream with
an `ErrorEvent`, and the engine context is always closed (and purged) when a job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from wim_service.wim.backend import (
    Backend,
    ContextSession,
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    PromptCost,
    RequestKind,
)
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import (
    AnswerEvent,
    DoneEvent,
    ErrorEvent,
    MarginEvent,
    SegmentEvent,
    Timings,
    Usage,
    WiMEvent,
)
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.prompts import MarginNote, PromptBuilder
from wim_service.wim.segmentation import Segment, segment_document
from wim_service.wim.tokenizer import EncodedText, Tokenizer

logger = logging.getLogger(__name__)

Emit = Callable[[WiMEvent], None]

# Room kept for a query's tokens when a document session is opened before any query is known.
QUERY_RESERVE_TOKENS = 256


@dataclass(frozen=True)
class DocumentPlan:
    """A document tokenized once and cut into segments, with the prompt prefix before it."""

    text: str
    encoded: EncodedText
    prefix_ids: list[int]
    segments: list[Segment]

    @property
    def context_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.encoded.ids)

    def context_ids(self, end: int) -> list[int]:
        """Prompt tokens up to document token `end` (the prefix included)."""
        return self.prefix_ids + self.encoded.ids[:end]


def plan_document(
    builder: PromptBuilder, document: str, options: WiMOptions, limits: EngineLimits
) -> DocumentPlan:
    if not document.strip():
        raise WiMError(ErrorCode.INVALID_INPUT, "the document is empty")
    encoded = builder.tokenizer.encode_user_text(document)
    prefix = builder.context_prefix
    if len(prefix) + len(encoded.ids) >= limits.max_model_len:
        raise WiMError(
            ErrorCode.TOO_LONG,
            f"the document is {len(encoded.ids)} tokens; with the {len(prefix)}-token prompt "
            f"prefix it does not fit the model's {limits.max_model_len}-token context window",
        )
    segments = segment_document(
        document,
        encoded,
        target_tokens=options.segment_tokens,
        max_tokens=options.segment_cap,
        block_size=limits.block_size,
        prefix_tokens=len(prefix),
    )
    return DocumentPlan(document, encoded, prefix, segments)


def check_fits(
    plan: DocumentPlan,
    builder: PromptBuilder,
    limits: EngineLimits,
    query: str,
    options: WiMOptions,
) -> None:
    """Refuse a query whose worst case cannot fit the context window, before any engine work."""
    _check_query(query)
    margin_suffix = builder.margin_suffix(query, options.relevance)
    worst_margin = plan.context_tokens + len(margin_suffix) + options.margin_max_tokens
    per_margin = builder.margin_entry_overhead() + options.margin_max_tokens
    worst_final = (
        plan.context_tokens
        + len(builder.final_suffix(query, []))
        + len(plan.segments) * per_margin
        + options.answer_max_tokens
    )
    worst = max(worst_margin, worst_final)
    if worst > limits.max_model_len:
        raise WiMError(
            ErrorCode.TOO_LONG,
            f"document ({plan.context_tokens} tokens with the prompt prefix) + query + "
            f"{len(plan.segments)} margins of up to {options.margin_max_tokens} tokens + "
            f"{options.answer_max_tokens} answer tokens needs up to {worst} tokens; the model's "
            f"context window is {limits.max_model_len}. Send a shorter document, or lower "
            "margin_max_tokens / answer_max_tokens.",
        )


@dataclass
class _Ledger:
    """Prompt-token accounting of one job."""

    submitted: int = 0
    cached: int = 0
    minimal: int = 0
    margin_tokens: int = 0
    answer_tokens: int = 0

    def add(self, cost: PromptCost | None, *, minimal: int) -> None:
        if cost is not None:
            self.submitted += cost.submitted
            self.cached += cost.cached
        self.minimal += minimal

    def usage(self, plan: DocumentPlan) -> Usage:
        return Usage(
            context_tokens=plan.context_tokens,
            segments=len(plan.segments),
            prompt_tokens_submitted=self.submitted,
            prompt_tokens_computed=self.submitted - self.cached,
            prompt_tokens_cached=self.cached,
            minimal_prompt_tokens=self.minimal,
            margin_tokens=self.margin_tokens,
            answer_tokens=self.answer_tokens,
        )


@dataclass
class _Generated:
    token_ids: list[int]
    text: str
    cost: PromptCost | None


async def _consume(
    stream: AsyncIterator[GenerationChunk],
    tokenizer: Tokenizer,
    *,
    stop: list[str],
    keep_going: Callable[[int], bool] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> _Generated:
    """Drain a generation: decode incrementally, honour stop strings, stream text deltas.

    `keep_going(first_token)` may end the generation right after its first token. Text that
    could still turn out to begin a stop string is held back from `on_text` until resolved.
    """
    ids: list[int] = []
    text, emitted = "", 0
    cost: PromptCost | None = None
    holdback = max((len(s) for s in stop), default=1) - 1
    try:
        async for chunk in stream:
            if cost is None:
                cost = chunk.cost
            first = not ids
            ids.extend(chunk.token_ids)
            if first and ids and keep_going is not None and not keep_going(ids[0]):
                break
            text = tokenizer.decode(ids)
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
            # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for its next token.
            stable = len(text) if cut >= 0 or chunk.finished else len(text.rstrip("\ufffd"))
            limit = stable if cut >= 0 or chunk.finished else max(stable - holdback, emitted)
            if on_text is not None and limit > emitted:
                on_text(text[emitted:limit])
                emitted = limit
            if cut >= 0:
                break
    finally:
        # Leaving early (stop string, NO first token, cancellation) aborts the request.
        await stream.aclose()  # type: ignore[attr-defined]
    return _Generated(ids, text, cost)


def _strip_relevance_word(text: str, word: str) -> str:
    body = text.lstrip()
    if body.upper().startswith(word.upper()):
        body = body[len(word) :]
    return body.lstrip(" \t\n:#-,.;")


class WiMSession:
    """One document in one engine context, answering one or many queries."""

    def __init__(
        self,
        backend: Backend,
        builder: PromptBuilder,
        plan: DocumentPlan,
        options: WiMOptions,
        context: ContextSession,
    ) -> None:
        self.backend = backend
        self.builder = builder
        self.plan = plan
        self.options = options
        self.context = context
        self.yes_ids, self.no_ids = builder.relevance_token_ids()
        self._closed = False
        self._lock = asyncio.Lock()  # one query at a time per session

    # -- steps -------------------------------------------------------------------------

    def _stop_ids(self, options: WiMOptions) -> frozenset[int]:
        return self.builder.tokenizer.eos_token_ids | frozenset(options.stop_token_ids)

    async def _margin(
        self,
        segment: Segment,
        query: str,
        suffix: list[int],
        options: WiMOptions,
        ledger: _Ledger,
        emit: Emit,
    ) -> MarginNote | None:
        """Write (and judge) the margin of `segment`; returns it if relevant."""
        submitted = time.perf_counter()
        first_token = options.relevance is RelevanceMode.FIRST_TOKEN
        params = GenerationParams(
            kind=RequestKind.MARGIN,
            max_tokens=options.margin_max_tokens,
            stop_token_ids=self._stop_ids(options),
            first_token_ids=(self.yes_ids | self.no_ids) if first_token else None,
        )
        verdict: list[bool] = []

        def keep_going(token: int) -> bool:
            verdict.append(token in self.yes_ids)
            return verdict[0]

        prefix_tokens = len(self.plan.prefix_ids) + segment.token_end
        generated = await _consume(
            self.context.branch(prefix_tokens, suffix, params),
            self.builder.tokenizer,
            stop=options.margin_stop,
            keep_going=keep_going if first_token else None,
        )
        ledger.add(generated.cost, minimal=len(suffix))
        ledger.margin_tokens += len(generated.token_ids)
        text = generated.text.strip()
        if first_token:
            relevant = bool(verdict and verdict[0])
            text = _strip_relevance_word(text, self.builder.templates.yes) if relevant else ""
        elif options.relevance is RelevanceMode.CLASSIFIER:
            relevant = await self._classify(query, text, options, ledger)
        else:
            relevant = True
        relevant = relevant and bool(text)
        emit(
            MarginEvent(
                segment=segment.index,
                text=text,
                relevant=relevant,
                char_start=segment.char_start,
                char_end=segment.char_end,
                elapsed_s=time.perf_counter() - submitted,
            )
        )
        return MarginNote(segment.index, text) if relevant else None

    async def _classify(
        self, query: str, margin: str, options: WiMOptions, ledger: _Ledger
    ) -> bool:
        if not margin:
            return False
        prompt = self.builder.classifier_prompt(query, margin)
        params = GenerationParams(
            kind=RequestKind.CLASSIFIER,
            max_tokens=1,
            stop_token_ids=self._stop_ids(options),
            first_token_ids=self.yes_ids | self.no_ids,
        )
        generated = await _consume(
            self.context.generate(prompt, params), self.builder.tokenizer, stop=[]
        )
        ledger.add(generated.cost, minimal=len(prompt))
        ledger.margin_tokens += len(generated.token_ids)
        return bool(generated.token_ids) and generated.token_ids[0] in self.yes_ids

    async def read(
        self,
        emit: Emit,
        ledger: _Ledger,
        timings: Timings,
        started: float,
        *,
        query: str | None = None,
        options: WiMOptions | None = None,
        pipelined: bool = True,
    ) -> list[MarginNote]:
        """Prefill every segment; with a query, write each margin as soon as its segment is in.

        Pipelined: margin i is submitted right after segment i's KV is computed, together with
        the push of segment i+1, so both share engine steps. Otherwise margin i is awaited first.
        """
        options = options or self.options
        suffix = self.builder.margin_suffix(query, options.relevance) if query is not None else []
        concurrent = pipelined and self.backend.limits.concurrent_branches
        tasks: list[asyncio.Task[MarginNote | None]] = []
        try:
            for segment in self.plan.segments:
                chunk = self.plan.encoded.ids[segment.token_start : segment.token_end]
                if segment.index == 0:
                    chunk = self.plan.prefix_ids + chunk
                cost = await self.context.extend(chunk)
                ledger.add(cost, minimal=len(chunk))
                emit(
                    SegmentEvent(
                        segment=segment.index,
                        segments=len(self.plan.segments),
                        tokens=segment.num_tokens,
                        context_tokens=segment.token_end,
                        char_start=segment.char_start,
                        char_end=segment.char_end,
                    )
                )
                if query is None:
                    continue
                task = asyncio.create_task(
                    self._margin(segment, query, suffix, options, ledger, emit)
                )
                tasks.append(task)
                if not concurrent:
                    await task
            timings.prefill_s = time.perf_counter() - started
            notes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        if tasks:
            timings.margins_s = time.perf_counter() - started
        return [note for note in notes if note is not None] if tasks else []

    async def ask_margins(
        self, query: str, options: WiMOptions, emit: Emit, ledger: _Ledger
    ) -> list[MarginNote]:
        """Margins of every segment for a new query over the already-read document."""
        suffix = self.builder.margin_suffix(query, options.relevance)
        if not self.backend.limits.concurrent_branches:
            # One at a time: creating every task up front would start them all at once.
            notes = [
                await self._margin(segment, query, suffix, options, ledger, emit)
                for segment in self.plan.segments
            ]
            return [note for note in notes if note is not None]
        tasks = [
            asyncio.create_task(self._margin(segment, query, suffix, options, ledger, emit))
            for segment in self.plan.segments
        ]
        try:
            notes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return [note for note in notes if note is not None]

    async def answer(
        self,
        query: str,
        notes: list[MarginNote],
        options: WiMOptions,
        emit: Emit,
        ledger: _Ledger,
        timings: Timings,
        started: float,
        *,
        conclude: bool,
    ) -> str:
        """Generate the answer after the whole document and the relevant margins.

        `conclude` appends the final prompt to the context itself (no recompute at all; the
        session takes no further query); otherwise the answer is a branch over the context.
        """
        suffix = self.builder.final_suffix(query, notes)
        params = GenerationParams(
            kind=RequestKind.ANSWER,
            max_tokens=options.answer_max_tokens,
            stop_token_ids=self._stop_ids(options),
        )
        stream = (
            self.context.conclude(suffix, params)
            if conclude
            else self.context.branch(self.plan.context_tokens, suffix, params)
        )

        def on_text(delta: str) -> None:
            if not timings.answer_ttft_s:
                timings.answer_ttft_s = time.perf_counter() - started
            emit(AnswerEvent(text=delta))

        generated = await _consume(
            stream, self.builder.tokenizer, stop=options.answer_stop, on_text=on_text
        )
        ledger.add(generated.cost, minimal=len(suffix))
        ledger.answer_tokens += len(generated.token_ids)
        return generated.text.strip()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.context.close()

    # -- public entry points -----------------------------------------------------------

    def query(self, query: str, options: WiMOptions | None = None) -> AsyncIterator[WiMEvent]:
        """Answer a new query over the read document (a document session's second call)."""
        options = options or self.options

        async def job(emit: Emit) -> None:
            async with self._lock:
                if self._closed:
                    raise WiMError(ErrorCode.INVALID_INPUT, "the document session is closed")
                check_fits(self.plan, self.builder, self.backend.limits, query, options)
                started = time.perf_counter()
                ledger, timings = _Ledger(), Timings()
                notes = await self.ask_margins(query, options, emit, ledger)
                timings.margins_s = time.perf_counter() - started
                answer = await self.answer(
                    query, notes, options, emit, ledger, timings, started, conclude=False
                )
                timings.total_s = time.perf_counter() - started
                emit(DoneEvent(answer=answer, usage=ledger.usage(self.plan), timings=timings))

        return _event_stream(job)


def _check_query(query: str) -> None:
    if not query.strip():
        raise WiMError(ErrorCode.INVALID_INPUT, "the query is empty")


def reserve_blocks(
    context_tokens: int,
    num_segments: int,
    options: WiMOptions,
    limits: EngineLimits,
    query_tokens: int = QUERY_RESERVE_TOKENS,
) -> int:
    """Worst-case KV blocks of a job: its context with the final prompt and answer, plus every
    margin in flight at once (each holds its partial block, instruction and margin tokens)."""
    block = limits.block_size
    per_margin = options.margin_max_tokens + 2 * query_tokens + 64
    final = context_tokens + num_segments * per_margin + options.answer_max_tokens
    branch = block + query_tokens + 128 + options.margin_max_tokens
    return min(
        math.ceil(final / block) + num_segments * math.ceil(branch / block),
        # Never more than the window itself plus one branch each: the cap keeps a long
        # document admissible on an engine that can hold it.
        math.ceil(limits.max_model_len / block) * 2 + num_segments,
    )


async def _open(
    backend: Backend,
    builder: PromptBuilder,
    plan: DocumentPlan,
    options: WiMOptions,
    query_tokens: int,
) -> WiMSession:
    reserve = reserve_blocks(
        plan.context_tokens, len(plan.segments), options, backend.limits, query_tokens
    )
    context = await backend.open_context(reserve_blocks=reserve)
    return WiMSession(backend, builder, plan, options, context)


def run_wim(
    backend: Backend,
    tokenizer: Tokenizer,
    document: str,
    query: str,
    options: WiMOptions | None = None,
    *,
    pipelined: bool = True,
) -> AsyncIterator[WiMEvent]:
    """One job: read `document` writing margins for `query`, then answer. Yields events."""
    options = options or WiMOptions()
    builder = PromptBuilder(tokenizer, options.prompts)

    async def job(emit: Emit) -> None:
        plan = plan_document(builder, document, options, backend.limits)
        check_fits(plan, builder, backend.limits, query, options)
        started = time.perf_counter()
        query_tokens = len(tokenizer.encode_user_text(query).ids)
        session = await _open(backend, builder, plan, options, query_tokens)
        try:
            timings, ledger = Timings(), _Ledger()
            timings.queue_s = time.perf_counter() - started
            started = time.perf_counter()
            notes = await session.read(
                emit, ledger, timings, started, query=query, options=options, pipelined=pipelined
            )
            answer = await session.answer(
                query, notes, options, emit, ledger, timings, started, conclude=True
            )
            timings.total_s = time.perf_counter() - started
            emit(DoneEvent(answer=answer, usage=ledger.usage(session.plan), timings=timings))
        finally:
            await session.close()

    return _event_stream(job)


async def open_document(
    backend: Backend,
    tokenizer: Tokenizer,
    document: str,
    options: WiMOptions | None = None,
    *,
    emit: Emit | None = None,
) -> WiMSession:
    """Read a document into a pinned context for later queries (a document session)."""
    options = options or WiMOptions()
    builder = PromptBuilder(tokenizer, options.prompts)
    plan = plan_document(builder, document, options, backend.limits)
    session = await _open(backend, builder, plan, options, QUERY_RESERVE_TOKENS)
    try:
        started = time.perf_counter()
        await session.read(emit or (lambda _: None), _Ledger(), Timings(), started)
    except BaseException:
        await session.close()
        raise
    return session


async def _event_stream(job: Callable[[Emit], Awaitable[None]]) -> AsyncIterator[WiMEvent]:
    """Run `job` in a task and yield what it emits; an error becomes the last event.

    If the consumer stops early (client gone), the job task is cancelled, which closes its
    engine requests and its context.
    """
    queue: asyncio.Queue[WiMEvent | None] = asyncio.Queue()

    async def runner() -> None:
        try:
            await job(queue.put_nowait)
        except WiMError as exc:
            queue.put_nowait(
                ErrorEvent(
                    code=exc.code.value, message=exc.message, retry_after_s=exc.retry_after_s
                )
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure must end the stream, not hang it
            logger.exception("WiM job failed")
            queue.put_nowait(
                ErrorEvent(code=ErrorCode.ENGINE_ERROR.value, message=f"engine error: {exc}")
            )
        finally:
            queue.put_nowait(None)

    task = asyncio.create_task(runner())
    try:
        while (event := await queue.get()) is not None:
            yield event
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
