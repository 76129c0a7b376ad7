"""The WiM loop: read a document segment by segment, write margins, answer.

`WiMSession` holds one document pinned in one engine context. A one-shot job (`run_wim`) reads
the document with the query known, so margin i is submitted together with the push of segment
i+1 and runs in the same engine steps; a document session (`open_document`) reads the document
once and then answers many queries, each as branches over the pinned context.

The session pushes segments and awaits the answer; a query's state is a `QueryRun`
(`wim.query`), its margins are written by `wim.margins`, the answers started before its last
margin ends are `wim.early`'s, and which margins become notes is `wim.notes`'s rule.

Everything a job produces is an event (`wim_service.wim.events`); errors end the stream with
an `ErrorEvent`, and the engine context is always closed (and purged) when a job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from wim_service.wim.backend import NOT_STORED, Backend, ContextSession, StoredDocument
from wim_service.wim.early import EarlyAnswers, MarginTasks
from wim_service.wim.errors import ErrorCode, WiMError, logged_failure
from wim_service.wim.events import AnswerEvent, DoneEvent, ErrorEvent, SegmentEvent, WiMEvent
from wim_service.wim.margins import MarginWriter
from wim_service.wim.options import WiMOptions
from wim_service.wim.pinned import PinnedDocument
from wim_service.wim.plan import DocumentPlan, check_query, prepare_job, relevance_ids
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.query import Emit, Ledger, QueryRoom, QueryRun
from wim_service.wim.segmentation import Segment
from wim_service.wim.streams import Generated, consume, stop_tasks
from wim_service.wim.tokenizer import Tokenizer


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
        self.options = options
        self.document = PinnedDocument.of(builder, plan, context, backend.limits)
        # KV blocks reserved for one query beyond the context (a document session); a query
        # that may need more reserves the difference while it runs.
        self.query_blocks = plan.shape(builder, options, None).query_blocks(
            backend.limits.block_size, backend.limits.max_model_len
        )
        self._closed = False
        # The session's own query blocks: one query at a time runs in them.
        self._own_room = asyncio.Lock()
        self._queries: set[asyncio.Task[None]] = set()  # queries running or waiting for room
        # What `restore_document` loaded of a stored document (nothing until it is asked).
        self.restored = NOT_STORED

    # What the session pins, as its document holds them (read by the serving layer too).
    @property
    def builder(self) -> PromptBuilder:
        return self.document.builder

    @property
    def plan(self) -> DocumentPlan:
        return self.document.plan

    @property
    def context(self) -> ContextSession:
        return self.document.context

    @property
    def busy(self) -> bool:
        """Whether a query runs or waits on this session (an idle one may be reaped)."""
        return bool(self._queries)

    # -- steps -------------------------------------------------------------------------

    async def _push(self, group: list[Segment], emit: Emit, ledger: Ledger) -> None:
        """Append the segments of `group` to the context, as one push."""
        first, last = group[0], group[-1]
        chunk = self.plan.encoded.ids[first.token_start : last.token_end]
        if first.index == 0:
            chunk = self.plan.prefix_ids + chunk
        cost = await self.context.extend(chunk)
        ledger.add(cost, minimal=len(chunk))
        self._emit_segments(group, emit)

    def _emit_segments(self, group: list[Segment], emit: Emit) -> None:
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

    async def read_document(self, emit: Emit) -> None:
        """Prefill every segment, one push each, with no query yet (a document session)."""
        ledger = Ledger()  # a document session reports usage per query
        for segment in self.plan.segments:
            await self._push([segment], emit, ledger)

    async def restore_document(self, emit: Emit) -> bool:
        """Load the document's saved KV in one push, the same tokens the read would push
        (a context opened for a stored document, as its first push); False if the engine
        pushed nothing (nothing saved that fits), and the document is to be read."""
        self.restored = await self.context.restore(self.plan.prefix_ids + self.plan.encoded.ids)
        if self.restored.holds_document:
            self._emit_segments(self.plan.segments, emit)
        return self.restored.holds_document

    async def read(self, run: QueryRun, *, pipelined: bool = True) -> MarginTasks:
        """Prefill every segment, writing each margin as soon as its segment is in.

        Pipelined: margin i is submitted right after segment i's KV is computed, together with
        the push of segment i+1, so both share engine steps. Otherwise margin i is awaited first.
        Segments whose margin is skipped (`NotePolicy.none_can_be_kept`) need no boundary of
        their own: they are pushed together with the segments after them, up to the next one
        with a margin, in fewer and larger engine steps (each step has a fixed cost).
        Returns the margins' tasks, the last ones possibly still running (`answer` awaits them).
        """
        writer = MarginWriter(self.document, run)
        concurrent = pipelined and self.backend.limits.concurrent_branches
        tasks: MarginTasks = []
        try:
            for group in self._push_groups(writer):
                await self._push(group, run.emit, run.ledger)
                for segment in group:
                    task = asyncio.create_task(writer.write(segment))
                    tasks.append(task)
                    if not concurrent:
                        await task
            run.timings.prefill_s = time.perf_counter() - run.started
        except BaseException:
            await stop_tasks(tasks)
            raise
        return tasks

    def _push_groups(self, writer: MarginWriter) -> list[list[Segment]]:
        """Consecutive segments pushed as one: each group ends with a segment whose margin is
        written, or with the document's last segment."""
        groups: list[list[Segment]] = [[]]
        for segment in self.plan.segments:
            groups[-1].append(segment)
            if not writer.skips(segment):
                groups.append([])
        return [group for group in groups if group]

    async def ask_margins(self, run: QueryRun) -> MarginTasks:
        """Margins of every segment for a new query over the already-read document: their
        tasks, all running at once (`answer` awaits them), or already done one by one."""
        writer = MarginWriter(self.document, run)
        tasks: MarginTasks = []
        try:
            for segment in self.plan.segments:
                task = asyncio.create_task(writer.write(segment))
                tasks.append(task)
                if not self.backend.limits.concurrent_branches:
                    # One at a time: the reference backend works on one request at once.
                    await task
        except BaseException:
            await stop_tasks(tasks)
            raise
        return tasks

    async def answer(self, run: QueryRun, margins: MarginTasks, *, conclude: bool) -> None:
        """Await the margins, generate the answer after the document and the kept notes, and
        end the job with its `DoneEvent`.

        The notes get what the window leaves after the document and the answer, most relevant
        first; with no note the final prompt is exactly the plain long-context prompt.
        `conclude` appends the final prompt to the context itself (no recompute at all; the
        session takes no further query); otherwise the answer is a branch over the context.

        Margins still running when this is called (`answer_early`): answers start at once, as
        branches beside them, their text held back (`wim.early`). If one of them has exactly
        the final prompt every note makes, it stands, and the margins' last decode steps
        carried it; the others are discarded (their tokens are counted as
        `discarded_answer_tokens`). If none stands, the answer starts over with every note.
        """
        early = EarlyAnswers(self.document, run, margins)
        early.start()
        try:
            notes = await early.await_margins()
            if margins:
                run.timings.margins_s = time.perf_counter() - run.started
            suffix, shown = self.document.final_suffix(run.query, notes, run.options)
            generated = await self._final_answer(run, early, suffix, conclude=conclude)
        finally:
            await stop_tasks([*margins, *early.tasks])
        run.ledger.add(generated.cost, minimal=len(suffix))
        run.ledger.answer_tokens += len(generated.token_ids)
        held = {note.segment for note in shown}
        run.timings.total_s = time.perf_counter() - run.started
        run.emit(
            DoneEvent(
                answer=generated.text.strip(),
                notes=sorted(held),
                notes_dropped=sorted(n.segment for n in notes if n.segment not in held),
                usage=run.ledger.usage(self.plan),
                timings=run.timings,
            )
        )

    async def _final_answer(
        self, run: QueryRun, early: EarlyAnswers, suffix: list[int], *, conclude: bool
    ) -> Generated:
        """The answer over `suffix`: the early answer over it if one runs, else a new one."""

        def on_text(delta: str) -> None:
            if not run.timings.answer_ttft_s:
                run.timings.answer_ttft_s = time.perf_counter() - run.started
            run.emit(AnswerEvent(text=delta))

        standing = early.standing(suffix)
        await early.discard_all_but(standing)
        if standing is not None:
            standing.text.release(on_text)
            return await standing.task
        stream = (
            self.context.conclude(suffix, self.document.answer_params(run.options))
            if conclude
            else self.document.answer_branch(suffix, run.options)
        )
        return await consume(
            stream, self.builder.tokenizer, stop=run.options.answer_stop, on_text=on_text
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
        queries = list(self._queries)
        for task in queries:
            task.cancel()
        await self.context.close()
        if queries:
            await asyncio.wait(queries)

    @contextlib.asynccontextmanager
    async def _room(self, needed: int) -> AsyncIterator[int]:
        """The KV a query of up to `needed` blocks runs in: yields how many blocks it holds.

        The session reserved one query's blocks beside its document: the first query takes
        those (and reserves what it needs beyond them). While they are taken, another query
        runs side by side in blocks of its own if the engine has them free at once, so the
        questions of a hot document on one replica need not take turns; if it has not, the
        query waits for the session's blocks rather than for the engine's (queued there, it
        would hold up new sessions, and could be refused after the admission timeout).
        """
        if self._own_room.locked() and self.backend.limits.concurrent_branches:
            async with self.context.reserve_more(needed, wait=False) as reserved:
                if reserved:
                    yield needed
                    return
        async with self._own_room:
            if self._closed:
                raise _closed_under_query()
            async with self.context.reserve_more(max(0, needed - self.query_blocks)):
                yield max(needed, self.query_blocks)

    # -- public entry points -----------------------------------------------------------

    def query(self, query: str, options: WiMOptions | None = None) -> AsyncIterator[WiMEvent]:
        """Answer a new query over the read document (a document session's second call)."""
        options = options or self.options

        async def job(emit: Emit) -> None:
            if self._closed:
                raise _closed_under_query()
            task = asyncio.current_task()
            assert task is not None
            self._queries.add(task)
            try:
                await answer_query(emit)
            except asyncio.CancelledError:
                if not self._closed:
                    raise
                # `close` stopped it (DELETE, expiry, reap): the client is told why its
                # stream ends, instead of seeing it cut off.
                task.uncancel()
                raise _closed_under_query() from None
            finally:
                self._queries.discard(task)

        async def answer_query(emit: Emit) -> None:
            limits = self.backend.limits
            shape = check_query(self.plan, self.builder, limits, query, options)
            needed = shape.query_blocks(limits.block_size, limits.max_model_len)
            async with self._room(needed) as blocks:
                room = QueryRoom(shape, blocks)
                run = QueryRun(query, options, emit, room, started=time.perf_counter())
                margins = await self.ask_margins(run)
                await self.answer(run, margins, conclude=False)

        return _event_stream(job)


async def _open(
    backend: Backend,
    builder: PromptBuilder,
    plan: DocumentPlan,
    options: WiMOptions,
    reserve_blocks: int,
    stored: StoredDocument | None = None,
) -> WiMSession:
    """A session over a new context holding `reserve_blocks` of KV (saved as `stored`).

    Everything that can refuse the job is checked before the reservation is taken; from the
    reservation on, any failure closes the context, which gives it back.
    """
    relevance_ids(builder)
    context = await backend.open_context(reserve_blocks=reserve_blocks, stored=stored)
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
            queue_s = time.perf_counter() - started
            room = QueryRoom(shape, reserve - shape.context_blocks(limits.block_size))
            run = QueryRun(query, options, emit, room, started=time.perf_counter())
            run.timings.queue_s = queue_s
            margins = await session.read(run, pipelined=pipelined)
            await session.answer(run, margins, conclude=True)
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
    stored: StoredDocument | None = None,
    restore: bool = True,
) -> WiMSession:
    """Read a document into a pinned context for later queries (a document session).

    With `stored`, the engine saves the document's KV as it is read, and with `restore` a
    document saved before (by any engine that keeps KV in the same store) is restored instead
    of read (`WiMSession.restored` says what was loaded)."""
    options = options or WiMOptions()
    builder = PromptBuilder(tokenizer, options.prompts)
    limits = backend.limits
    plan, shape = await asyncio.to_thread(prepare_job, builder, document, options, limits)
    reserve = shape.session_blocks(limits.block_size, limits.max_model_len)
    session = await _open(backend, builder, plan, options, reserve, stored)
    emit = emit or (lambda _: None)
    try:
        if stored is None or not restore or not await session.restore_document(emit):
            await session.read_document(emit)
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
