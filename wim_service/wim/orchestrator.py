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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from wim_service.wim.backend import (
    Backend,
    ContextSession,
    GenerationChunk,
    GenerationParams,
    PromptCost,
    RequestKind,
)
from wim_service.wim.capacity import JobShape
from wim_service.wim.errors import ErrorCode, WiMError, logged_failure
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
from wim_service.wim.grounding import SegmentText
from wim_service.wim.notes import NotePolicy
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.plan import DocumentPlan, check_query, prepare_job, relevance_ids
from wim_service.wim.prompts import MarginNote, PromptBuilder
from wim_service.wim.segmentation import Segment, leading_sentences
from wim_service.wim.streams import Generated, HeldText, consume, recorded, stop_tasks
from wim_service.wim.tokenizer import Tokenizer

Emit = Callable[[WiMEvent], None]


@dataclass
class _Ledger:
    """Prompt-token accounting of one job."""

    submitted: int = 0
    cached: int = 0
    minimal: int = 0
    margin_tokens: int = 0
    answer_tokens: int = 0
    discarded_answer_tokens: int = 0

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
            discarded_answer_tokens=self.discarded_answer_tokens,
        )


def _strip_relevance_word(text: str, word: str) -> str:
    body = text.lstrip()
    if body.upper().startswith(word.upper()):
        body = body[len(word) :]
    return body.lstrip(" \t\n:#-,.;")


def _note_text(note: MarginNote | None) -> str | None:
    """What a margin's outcome puts in the final prompt: its note's text, or nothing."""
    return note.text if note is not None else None


@dataclass
class _EarlyAnswer:
    """An answer started before the last margins ended, over the notes kept until then (and
    maybe the notes the running margins are expected to give)."""

    suffix: list[int]  # its final prompt
    # The note text (or None: no note) it takes each margin running at its start to give.
    assumes: dict[int, str | None]
    text: HeldText
    chunks: list[GenerationChunk]
    task: asyncio.Task[Generated]

    def refuted_by(self, segment: int, note: MarginNote | None) -> bool:
        """Whether the margin of `segment` ended otherwise than this answer assumed: then its
        final prompt is not the one the notes make. Notes are compared by text: their rank only
        orders them for the window, and the answer that stands is checked against the final
        prompt itself, so a wrong call here costs time, never a wrong answer."""
        return segment in self.assumes and self.assumes[segment] != _note_text(note)

    async def discard(self, ledger: _Ledger) -> None:
        """Stop it (a later note changed the final prompt) and book the work it did."""
        self.task.cancel()
        await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.exception()  # an early answer that failed is as moot as one that did not
        cost = next((chunk.cost for chunk in self.chunks if chunk.cost is not None), None)
        # Its final prompt counts as minimal too: the request was meant, not a cache miss.
        ledger.add(cost, minimal=len(self.suffix) if cost is not None else 0)
        ledger.discarded_answer_tokens += sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(frozen=True)
class QueryRoom:
    """The KV blocks a query may hold beyond the pinned context, and the shape of its job."""

    shape: JobShape
    blocks: int

    def holds_early_answers(
        self, block: int, pending_margins: int, suffix_tokens: Sequence[int]
    ) -> bool:
        return self.shape.early_answer_blocks(block, pending_margins, suffix_tokens) <= self.blocks


def _closed_under_query() -> WiMError:
    """A query on a session that was closed before it could run, or while it ran."""
    return WiMError(ErrorCode.NOT_FOUND, "the document session was closed (deleted or expired)")


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
        self.yes_ids, self.no_ids = relevance_ids(builder)
        # KV blocks reserved for one query beyond the context (a document session); a query
        # that may need more reserves the difference while it runs.
        self.query_blocks = plan.shape(builder, options, None).query_blocks(
            backend.limits.block_size, backend.limits.max_model_len
        )
        # Each segment's sentences, parsed on first use and kept for every later query.
        self.segment_texts = [SegmentText(plan.text, s) for s in plan.segments]
        # What each running margin has written so far (as `ground` will read it), by segment:
        # early answers are started over the notes these drafts still point to.
        self._drafts: dict[int, str] = {}
        self._closed = False
        self._lock = asyncio.Lock()  # one query at a time per session
        self._queries = 0  # queries running or waiting for the lock
        self._running: asyncio.Task[None] | None = None  # the task of the query holding it

    @property
    def busy(self) -> bool:
        """Whether a query runs or waits on this session (an idle one may be reaped)."""
        return self._queries > 0

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
        segment_text = self.segment_texts[segment.index]
        policy = NotePolicy.of(options)
        if policy.none_can_be_kept(segment_text, query):
            emit(
                MarginEvent(
                    segment=segment.index,
                    text="",
                    relevant=False,
                    skipped=True,
                    char_start=segment.char_start,
                    char_end=segment.char_end,
                    elapsed_s=0.0,
                )
            )
            return None
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

        cut_short = False

        def written(text: str) -> str:
            # The margin as `ground` will see it: a first-token margin without its YES.
            return _strip_relevance_word(text, self.builder.templates.yes) if first_token else text

        def enough(text: str) -> bool:
            nonlocal cut_short
            body = written(text)
            self._drafts[segment.index] = body
            if options.margin_max_sentences and leading_sentences(
                body, options.margin_max_sentences
            ):
                return True
            # Grounding or the query filter will drop it whatever follows; stop paying for it.
            cut_short = policy.cannot_keep(segment_text, body, query)
            return cut_short

        prefix_tokens = len(self.plan.prefix_ids) + segment.token_end
        try:
            generated = await consume(
                self.context.branch(prefix_tokens, suffix, params),
                self.builder.tokenizer,
                stop=options.margin_stop,
                keep_going=keep_going if first_token else None,
                give_up=enough,
            )
        finally:
            self._drafts.pop(segment.index, None)
        ledger.add(generated.cost, minimal=len(suffix))
        ledger.margin_tokens += len(generated.token_ids)
        text = generated.text.strip()
        said_yes = bool(verdict and verdict[0])
        if first_token:
            text = written(text) if said_yes else ""
        if options.margin_max_sentences:
            # The token that began the next sentence is not part of the margin.
            text = leading_sentences(text, options.margin_max_sentences) or text
        if first_token:
            relevant = said_yes
        elif options.relevance is RelevanceMode.CLASSIFIER:
            # A cut-short margin is dropped whatever the verdict: no request to judge it.
            relevant = not cut_short and await self._classify(query, text, options, ledger)
        else:
            relevant = True
        relevant = relevant and bool(text)
        judged = policy.judge(segment_text, query, text, relevant=relevant)
        evidence = judged.evidence
        emit(
            MarginEvent(
                segment=segment.index,
                text=text,
                relevant=relevant,
                grounded=judged.grounding.grounded,
                cut_short=cut_short,
                kept=judged.kept,
                evidence=evidence.text if evidence else "",
                evidence_start=evidence.char_start if evidence else None,
                evidence_end=evidence.char_end if evidence else None,
                char_start=segment.char_start,
                char_end=segment.char_end,
                elapsed_s=time.perf_counter() - submitted,
            )
        )
        return judged.note_of(segment.index)

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
        generated = await consume(
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
    ) -> list[asyncio.Task[MarginNote | None]]:
        """Prefill every segment; with a query, write each margin as soon as its segment is in.

        Pipelined: margin i is submitted right after segment i's KV is computed, together with
        the push of segment i+1, so both share engine steps. Otherwise margin i is awaited first.
        Segments whose margin is skipped (`no_note_can_be_kept`) need no boundary of their own:
        they are pushed together with the segments after them, up to the next one with a
        margin, in fewer and larger engine steps (each step has a fixed cost).
        Returns the margins' tasks, the last ones possibly still running (`answer` awaits them).
        """
        options = options or self.options
        suffix = self.builder.margin_suffix(query, options.relevance) if query is not None else []
        concurrent = pipelined and self.backend.limits.concurrent_branches
        tasks: list[asyncio.Task[MarginNote | None]] = []
        try:
            for group in self._push_groups(query, options):
                first, last = group[0], group[-1]
                chunk = self.plan.encoded.ids[first.token_start : last.token_end]
                if first.index == 0:
                    chunk = self.plan.prefix_ids + chunk
                cost = await self.context.extend(chunk)
                ledger.add(cost, minimal=len(chunk))
                for segment in group:
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
                for segment in group:
                    task = asyncio.create_task(
                        self._margin(segment, query, suffix, options, ledger, emit)
                    )
                    tasks.append(task)
                    if not concurrent:
                        await task
            timings.prefill_s = time.perf_counter() - started
        except BaseException:
            await stop_tasks(tasks)
            raise
        return tasks

    def _push_groups(self, query: str | None, options: WiMOptions) -> list[list[Segment]]:
        """Consecutive segments pushed as one: each group ends with a segment whose margin is
        written, or with the document's last segment. Without a query, one segment each."""
        groups: list[list[Segment]] = [[]]
        for segment in self.plan.segments:
            groups[-1].append(segment)
            if query is None or not NotePolicy.of(options).none_can_be_kept(
                self.segment_texts[segment.index], query
            ):
                groups.append([])
        return [group for group in groups if group]

    async def ask_margins(
        self, query: str, options: WiMOptions, emit: Emit, ledger: _Ledger
    ) -> list[asyncio.Task[MarginNote | None]]:
        """Margins of every segment for a new query over the already-read document: their
        tasks, all running at once (`answer` awaits them), or already done one by one."""
        suffix = self.builder.margin_suffix(query, options.relevance)
        tasks: list[asyncio.Task[MarginNote | None]] = []
        try:
            for segment in self.plan.segments:
                task = asyncio.create_task(
                    self._margin(segment, query, suffix, options, ledger, emit)
                )
                tasks.append(task)
                if not self.backend.limits.concurrent_branches:
                    # One at a time: the reference backend works on one request at once.
                    await task
        except BaseException:
            await stop_tasks(tasks)
            raise
        return tasks

    def _final_suffix(
        self, query: str, notes: list[MarginNote], options: WiMOptions
    ) -> tuple[list[int], list[MarginNote]]:
        budget = (
            self.backend.limits.max_model_len - self.plan.context_tokens - options.answer_max_tokens
        )
        return self.builder.final_suffix_within(query, notes, budget)

    def _answer_params(self, options: WiMOptions) -> GenerationParams:
        return GenerationParams(
            kind=RequestKind.ANSWER,
            max_tokens=options.answer_max_tokens,
            stop_token_ids=self._stop_ids(options),
        )

    def _answers_early(
        self,
        query: str,
        margins: list[asyncio.Task[MarginNote | None]],
        options: WiMOptions,
        room: QueryRoom,
        early: Sequence[_EarlyAnswer],
    ) -> list[_EarlyAnswer]:
        """Answers to start beside the margins still running, if any are and the query's
        reservation holds them together with `early`, the answers already running: the one
        over the notes kept so far plus those the running margins are expected to give
        (`_expected_note`) and, while no answer runs, the one over the kept notes alone, in
        case the running margins keep nothing. An answer over a final prompt that one of
        `early` already has is not started twice. At most one final prompt is the one the
        margins' notes make."""
        done = [task for task in margins if task.done()]
        if not options.answer_early or len(done) == len(margins):
            return []
        if any(task.cancelled() or task.exception() is not None for task in done):
            return []  # the job is failing: `answer` raises it
        known: list[MarginNote] = []
        guessed: list[MarginNote] = []
        running: list[int] = []
        pending = 0  # margins that will hold KV: a skipped one (its task not yet run) holds none
        for segment, task in zip(self.plan.segments, margins, strict=True):  # one per segment
            if task.done():
                if (note := task.result()) is not None:
                    known.append(note)
                continue
            running.append(segment.index)
            if not NotePolicy.of(options).none_can_be_kept(
                self.segment_texts[segment.index], query
            ):
                pending += 1
                if (note := self._expected_note(segment, query, options)) is not None:
                    guessed.append(note)
        nothing_kept = dict.fromkeys(running)
        versions = [] if early else [(self._final_suffix(query, known, options)[0], nothing_kept)]
        versions.append(
            (
                self._final_suffix(query, known + guessed, options)[0],
                nothing_kept | {note.segment: note.text for note in guessed},
            )
        )
        suffixes = [answer.suffix for answer in early]
        fresh: list[tuple[list[int], dict[int, str | None]]] = []
        for suffix, assumes in versions:
            if suffix not in suffixes:
                suffixes.append(suffix)
                fresh.append((suffix, assumes))
        block = self.backend.limits.block_size
        while fresh and not room.holds_early_answers(
            block, pending, [len(suffix) for suffix in suffixes]
        ):
            fresh.pop()  # the guess goes first
            suffixes.pop()
        return [self._start_early_answer(suffix, assumes, options) for suffix, assumes in fresh]

    async def _await_margins(
        self,
        query: str,
        margins: list[asyncio.Task[MarginNote | None]],
        options: WiMOptions,
        room: QueryRoom,
        early: list[_EarlyAnswer],
        ledger: _Ledger,
    ) -> list[MarginNote]:
        """The kept notes, once every margin has ended. Meanwhile, each time a margin ends, an
        early answer is discarded if that margin ended otherwise than it assumed, or if a
        margin still running has strayed from the note it expects of it (either would only
        slow the engine steps that the margins and the other answers share), and the answer
        over what is expected by then starts unless it runs already (`_answers_early`).
        `early` is updated in place: what is left of it may stand."""
        segment_of = {task: index for index, task in enumerate(margins)}  # one per segment
        running = {task for task in margins if not task.done()}
        while running:
            ended, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            outcomes = [(segment_of[task], task.result()) for task in ended]  # raises a failure
            for answer in list(early):
                if any(
                    answer.refuted_by(segment, note) for segment, note in outcomes
                ) or not self._drafts_follow(answer, options):
                    early.remove(answer)
                    await answer.discard(ledger)
            if running:
                early.extend(self._answers_early(query, margins, options, room, early))
        return [note for task in margins if (note := task.result()) is not None]

    def _start_early_answer(
        self, suffix: list[int], assumes: dict[int, str | None], options: WiMOptions
    ) -> _EarlyAnswer:
        chunks: list[GenerationChunk] = []
        text = HeldText()
        stream = self.context.branch(self.plan.context_tokens, suffix, self._answer_params(options))
        task = asyncio.create_task(
            consume(
                recorded(stream, chunks),
                self.builder.tokenizer,
                stop=options.answer_stop,
                on_text=text,
            )
        )
        return _EarlyAnswer(suffix, assumes, text, chunks, task)

    def _expected_note(
        self, segment: Segment, query: str, options: WiMOptions
    ) -> MarginNote | None:
        draft = self._drafts.get(segment.index, "")
        return NotePolicy.of(options).expected_note(self.segment_texts[segment.index], query, draft)

    def _draft_may_give(self, segment: int, note: str, options: WiMOptions) -> bool:
        return NotePolicy.of(options).may_still_give(self._drafts.get(segment, ""), note)

    def _drafts_follow(self, answer: _EarlyAnswer, options: WiMOptions) -> bool:
        """Whether every running margin that `answer` expects a note of may still give it."""
        return all(
            note is None or self._draft_may_give(segment, note, options)
            for segment, note in answer.assumes.items()
        )

    async def answer(
        self,
        query: str,
        margins: list[asyncio.Task[MarginNote | None]],
        options: WiMOptions,
        emit: Emit,
        ledger: _Ledger,
        timings: Timings,
        started: float,
        *,
        conclude: bool,
        room: QueryRoom,
    ) -> None:
        """Await the margins, generate the answer after the document and the kept notes, and
        end the job with its `DoneEvent`.

        The notes get what the window leaves after the document and the answer, most relevant
        first; with no note the final prompt is exactly the plain long-context prompt.
        `conclude` appends the final prompt to the context itself (no recompute at all; the
        session takes no further query); otherwise the answer is a branch over the context.

        Margins still running when this is called (`answer_early`): answers start at once, as
        branches beside them, their text held back: one over the notes kept so far and, with
        snapping, one that adds the sentence each running margin is expected to copy. Most
        margins end either as not kept or as expected; then one of those answers has exactly
        the final prompt every note makes, so it stands, and the margins' last decode steps
        carried it. The others are discarded (their tokens are counted as
        `discarded_answer_tokens`) as soon as a margin ends otherwise than they assumed, and
        the answer over what is expected then starts at once (`_await_margins`); if none
        stands at the end, the answer starts over with every note.
        """
        early = self._answers_early(query, margins, options, room, [])
        try:
            notes = await self._await_margins(query, margins, options, room, early, ledger)
            if margins:
                timings.margins_s = time.perf_counter() - started
            suffix, shown = self._final_suffix(query, notes, options)

            def on_text(delta: str) -> None:
                if not timings.answer_ttft_s:
                    timings.answer_ttft_s = time.perf_counter() - started
                emit(AnswerEvent(text=delta))

            standing = next((answer for answer in early if answer.suffix == suffix), None)
            for answer in early:
                if answer is not standing:
                    await answer.discard(ledger)
            if standing is not None:
                standing.text.release(on_text)
                generated = await standing.task
            else:
                params = self._answer_params(options)
                stream = (
                    self.context.conclude(suffix, params)
                    if conclude
                    else self.context.branch(self.plan.context_tokens, suffix, params)
                )
                generated = await consume(
                    stream, self.builder.tokenizer, stop=options.answer_stop, on_text=on_text
                )
        finally:
            await stop_tasks([*margins, *(answer.task for answer in early)])
        ledger.add(generated.cost, minimal=len(suffix))
        ledger.answer_tokens += len(generated.token_ids)
        held = {note.segment for note in shown}
        timings.total_s = time.perf_counter() - started
        emit(
            DoneEvent(
                answer=generated.text.strip(),
                notes=sorted(held),
                notes_dropped=sorted(n.segment for n in notes if n.segment not in held),
                usage=ledger.usage(self.plan),
                timings=timings,
            )
        )

    async def close(self) -> None:
        """End the session; a query still running is stopped and ends with `NOT_FOUND`.

        The context is closed before the query has unwound: its reservation, and what the
        query reserved beyond it, are then given back by the context once the engine no longer
        holds any block of the query's requests. Released when the query's task ended
        instead, they would go back while its aborted margins still sat in the engine, and
        admission control would admit a new session onto blocks that are not free yet.
        """
        if self._closed:
            return
        self._closed = True
        running = self._running
        if running is not None:
            running.cancel()
        await self.context.close()
        if running is not None:
            await asyncio.wait([running])

    # -- public entry points -----------------------------------------------------------

    def query(self, query: str, options: WiMOptions | None = None) -> AsyncIterator[WiMEvent]:
        """Answer a new query over the read document (a document session's second call)."""
        options = options or self.options

        async def job(emit: Emit) -> None:
            self._queries += 1
            try:
                async with self._lock:
                    if self._closed:
                        raise _closed_under_query()
                    self._running = asyncio.current_task()
                    try:
                        await run(emit)
                    except asyncio.CancelledError:
                        if not self._closed:
                            raise
                        # `close` stopped it (DELETE, expiry, reap): the client is told why its
                        # stream ends, instead of seeing it cut off.
                        asyncio.current_task().uncancel()
                        raise _closed_under_query() from None
                    finally:
                        self._running = None
            finally:
                self._queries -= 1

        async def run(emit: Emit) -> None:
            limits = self.backend.limits
            shape = check_query(self.plan, self.builder, limits, query, options)
            needed = shape.query_blocks(limits.block_size, limits.max_model_len)
            room = QueryRoom(shape, max(needed, self.query_blocks))
            async with self.context.reserve_more(max(0, needed - self.query_blocks)):
                started = time.perf_counter()
                ledger, timings = _Ledger(), Timings()
                margins = await self.ask_margins(query, options, emit, ledger)
                await self.answer(
                    query,
                    margins,
                    options,
                    emit,
                    ledger,
                    timings,
                    started,
                    conclude=False,
                    room=room,
                )

        return _event_stream(job)


async def _open(
    backend: Backend,
    builder: PromptBuilder,
    plan: DocumentPlan,
    options: WiMOptions,
    reserve_blocks: int,
) -> WiMSession:
    """A session over a new context holding `reserve_blocks` of KV.

    Everything that can refuse the job is checked before the reservation is taken; from the
    reservation on, any failure closes the context, which gives it back.
    """
    relevance_ids(builder)
    context = await backend.open_context(reserve_blocks=reserve_blocks)
    try:
        return WiMSession(backend, builder, plan, options, context)
    except BaseException:
        await context.close()
        raise


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
        limits = backend.limits
        plan, shape = await asyncio.to_thread(
            prepare_job, builder, document, options, limits, query
        )
        started = time.perf_counter()
        reserve = shape.one_shot_blocks(limits.block_size, limits.max_model_len)
        session = await _open(backend, builder, plan, options, reserve)
        try:
            timings, ledger = Timings(), _Ledger()
            timings.queue_s = time.perf_counter() - started
            started = time.perf_counter()
            margins = await session.read(
                emit, ledger, timings, started, query=query, options=options, pipelined=pipelined
            )
            room = QueryRoom(shape, reserve - shape.context_blocks(limits.block_size))
            await session.answer(
                query,
                margins,
                options,
                emit,
                ledger,
                timings,
                started,
                conclude=True,
                room=room,
            )
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
    limits = backend.limits
    plan, shape = await asyncio.to_thread(prepare_job, builder, document, options, limits)
    reserve = shape.session_blocks(limits.block_size, limits.max_model_len)
    session = await _open(backend, builder, plan, options, reserve)
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
            queue.put_nowait(ErrorEvent.of(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure must end the stream, not hang it
            failure = logged_failure(
                ErrorCode.ENGINE_ERROR, "the engine failed on this job", exc, "WiM job"
            )
            queue.put_nowait(ErrorEvent.of(failure))
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
