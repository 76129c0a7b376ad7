"""How one request runs on a simulated engine: its shape for placement (`Work`) and its
prefills and decodes, stage by stage.

A plain request (a Mooncake request, a document trace's `wim: false` row) prefills its prompt
past the cached prefix, then decodes its answer. A session's read (`read_work`) prefills its
document into a new copy. A WiM query on a document session reads the document first if
placement opened a copy for it (another replica's), writes its margins (one per segment, or the
trace row's `margins`: one prefill of every margin's prompt over the document's KV, then the
margins decode side by side in the batch), then prefills the query with the margins (and the
profile's `query_extra_tokens`: the answers started early beside the margins) and decodes the
answer. A copy runs one query at a time in the blocks it holds for one; a query arriving
while that runs starts at once beside it in blocks of its own if the engine has them free (as a
live session does), else waits its turn.
Placement sees one margin per segment, as the router does: which segments a query
skips is known only once they are read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from wim_service.placement import shapes
from wim_service.placement.ledger import Booking
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import Work
from wim_service.sim.engine import Engine
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request


def work_for(
    request: Request, profile: EngineProfile, settings: SimSettings, prefix_block_tokens: int
) -> Work:
    """The request as placement sees it, its KV reservation in the profile's blocks and its
    prefix in hashes of `prefix_block_tokens` (its trace's)."""
    block = profile.block_tokens
    if not request.wim:
        blocks = math.ceil((request.prompt_tokens + request.answer_tokens) / block)
        return shapes.plain(
            request.prompt_tokens,
            request.answer_tokens,
            blocks,
            prefix=request.prefix,
            block_tokens=prefix_block_tokens,
        )
    assert request.document is not None  # a WiM row names its document (`traces.py`)
    margins = math.ceil(request.document_tokens / settings.segment_tokens)
    # As a live session's: a copy reserves its document and one query (queries take turns in
    # that), so a query reserves nothing of its own at placement.
    document_blocks = math.ceil(request.document_tokens / block)
    document_blocks += query_blocks(request, profile, margins, settings.margin_tokens)
    return shapes.document_query(
        request.document,
        request.document_tokens,
        document_blocks,
        query_tokens=request.query_tokens,
        answer_tokens=request.answer_tokens,
        margins=margins,
        margin_tokens=settings.margin_tokens,
    )


def query_blocks(request: Request, profile: EngineProfile, margins: int, margin_tokens: int) -> int:
    """The KV of one WiM query over its document: its `margins` (prompt and output) at once,
    then the query, the margins and the answer."""
    own = margins * (profile.margin_prompt_tokens + 2 * margin_tokens)
    own += request.query_tokens + request.answer_tokens
    return math.ceil(own / profile.block_tokens)


def read_work(query: Work, *, restorable: bool = False) -> Work:
    """The session's first read of a query's document (`POST /documents`): placed on its own,
    as the live client opens a session before its first query; or its rebuild, once every
    replica holding it was lost (`restorable`: its KV was saved as it was first read)."""
    assert query.document is not None
    return shapes.document_read(
        query.document, query.document_tokens, query.document_blocks, restorable=restorable
    )


@dataclass(eq=False)
class Job:
    """One request placed on an engine, and what the report reads of it."""

    request: Request
    work: Work
    settings: SimSettings
    on_done: Callable[[Job, Engine, float], None]
    copy: bool = False  # placement opened a copy of the document for it
    placed_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    cached_tokens: int = 0
    margins_left: int = 0
    beside_blocks: int = 0  # KV of its own, if it runs beside the query in its copy's turn
    booked: int = 0  # its job in its engine's backlog (`Backlog.book`)
    # What placement booked for it in the ledger (None: it runs unbooked, as a query the
    # router sends to its session's primary when it places it nowhere else).
    booking: Booking | None = None
    # Called once the copy it opened is read (its query follows): the router's cue.
    on_read: Callable[[Job, float], None] | None = None
    # When the router stops it (`RouterConfig.request_timeout_s` after it was sent; a query
    # failed over keeps its request's clock); a session's read has none.
    due_s: float = math.inf
    # Its cost as cheapest-first admission booked it (`placement/admission.py`) when it was
    # admitted; None: not admitted by the rule (not yet, or the rule is off).
    cost: float | None = None
    _turn: Callable[[float], None] | None = None  # its start in its copy's turn

    def start(self, engine: Engine, now: float) -> None:
        """Book the job on `engine` and queue its first prefill (a document job's once the
        queries ahead of it on the same copy have ended). A query that opens a copy books
        its read first, then itself once read, as a live replica books the copy's read
        (`open_document`) and then the query the router sends after it."""
        profile, work = engine.profile, self.work
        self.placed_s = now
        opens = self.copy and not work.reads_only
        booked = read_work(work, restorable=True) if opens else work
        self.booked = engine.backlog.book(booked, copy=self.copy, now=now)
        if not self.request.wim:
            engine.book(work.kv_blocks, document=None)
            engine.submit(PlainPrefill(self), now)
            return
        if work.reads_only:  # a new copy (no holder had the document)
            copy = engine.book(0, document=work.document, copy_blocks=work.document_blocks)
            assert copy is not None
            copy.take(lambda at: engine.submit(ReadPrefill(self), at), now)
            return
        copy_blocks = work.document_blocks if self.copy else 0
        copy = engine.book(work.kv_blocks, document=work.document, copy_blocks=copy_blocks)
        assert copy is not None
        # As the live service reports it (the query's `usage`): a copy's read is the router's
        # own request, counted in the copies opened and in this query's wait, not in its prompt.
        self.cached_tokens = work.document_tokens
        own = query_blocks(self.request, profile, work.margins, work.margin_tokens)
        self._turn = partial(self._run_query, engine)
        self.beside_blocks = engine.run_query(copy, own, self._turn, now)

    def read(self, engine: Engine, now: float) -> None:
        """The copy it opened is read: the query is booked in its stead."""
        engine.backlog.end(self.booked)
        self.booked = engine.backlog.book(self.work, now=now)
        if self.on_read is not None:
            self.on_read(self, now)

    def _run_query(self, engine: Engine, now: float) -> None:
        """Queue the query's prefills: the copy's read (if placement opened one), then its
        margins, or the query itself when it writes none."""
        if self.copy:
            engine.submit(ReadPrefill(self), now)
        if self.margins:
            engine.submit(MarginsPrefill(self), now)
        else:  # every segment skipped: the query follows the document, queued once
            engine.submit(QueryPrefill(self), now)

    @property
    def margins(self) -> int:
        """The margins it writes (placement expected `work.margins`)."""
        written = self.request.margins
        return self.work.margins if written is None else written

    def margins_prefill_seconds(self, profile: EngineProfile) -> float:
        return profile.margins_prefill_seconds(self.margins, self.work.document_tokens)

    def query_prefill_seconds(self, profile: EngineProfile) -> float:
        return profile.answer_prefill_seconds(
            self.request.query_tokens,
            self.margins,
            self.work.margin_tokens,
            self.work.document_tokens,
        )

    def first_token(self, engine: Engine, now: float, context: int) -> None:
        """The prefill that ends now gave the answer's first token; decode the rest."""
        self.first_token_s = now
        if self.request.answer_tokens > 1:
            engine.decode(self, 1, self.request.answer_tokens - 1, context)
        else:
            self.finish(engine, now)

    def decoded(self, engine: Engine, now: float) -> None:
        if self.margins_left:
            self.margins_left -= 1
            if not self.margins_left:
                engine.submit(QueryPrefill(self), now)
            return
        self.finish(engine, now)

    def stop(self, engine: Engine, now: float) -> bool:
        """Stopped at its deadline, as the router stops a job (504 `deadline_exceeded`): the
        engine aborts what is left of it, and it gives back its KV and its copy's turn (or
        its place in the line for it). Whether the copy it opened was not read yet: the
        router's read of it is cancelled then, and nothing of the copy kept."""
        engine.stop(self, now)
        engine.backlog.end(self.booked)
        document = self.work.document
        copy = None if document is None else engine.copies[document]
        waiting = copy is not None and copy.leave(self._turn)
        blocks = self.work.kv_blocks + self.beside_blocks
        engine.release(blocks, now, document=document, in_turn=not (self.beside_blocks or waiting))
        return self.copy and copy is not None and not copy.read

    def finish(self, engine: Engine, now: float) -> None:
        self.end_s = now
        engine.backlog.end(self.booked)
        engine.release(
            self.work.kv_blocks + self.beside_blocks,
            now,
            document=self.work.document,
            in_turn=not self.beside_blocks,
        )
        self.on_done(self, engine, now)


def read_seconds(profile: EngineProfile, work: Work) -> float:
    """A copy's read of its document: restored from the KV store if it was read before."""
    return profile.read_seconds(work.document_tokens, saved=work.restorable)


def plain_seconds(profile: EngineProfile, work: Work, cached_blocks: int) -> float:
    cached = min(work.cached_tokens(cached_blocks), work.prompt_tokens - 1)
    return profile.prefill.seconds(work.prompt_tokens - cached, cached=cached)


@dataclass(eq=False)
class PlainPrefill:
    job: Job

    def begin(self, engine: Engine) -> float:
        work = self.job.work
        cached_blocks = engine.cache.match(work.prefix)
        # At least the last prompt token is computed, for its logits: vLLM's rule too.
        self.job.cached_tokens = min(work.cached_tokens(cached_blocks), work.prompt_tokens - 1)
        return plain_seconds(engine.profile, work, cached_blocks)

    def finish(self, engine: Engine, now: float) -> None:
        engine.cache.insert(self.job.work.prefix)
        self.job.first_token(engine, now, self.job.work.prompt_tokens + 1)


@dataclass(eq=False)
class ReadPrefill:
    """A copy of the document is read: its KV stays held for the session's later queries
    (until the copy is retired)."""

    job: Job

    def begin(self, engine: Engine) -> float:
        return read_seconds(engine.profile, self.job.work)

    def finish(self, engine: Engine, now: float) -> None:
        # The copy's KV was reserved at booking; a query's margins come next, already queued.
        document = self.job.work.document
        assert document is not None
        engine.copies[document].read = True
        if self.job.work.reads_only:
            self.job.finish(engine, now)
        else:
            self.job.read(engine, now)


@dataclass(eq=False)
class MarginsPrefill:
    job: Job

    def begin(self, engine: Engine) -> float:
        return self.job.margins_prefill_seconds(engine.profile)

    def finish(self, engine: Engine, now: float) -> None:
        job, profile = self.job, engine.profile
        steps = job.work.margin_tokens - 1  # the prefill gave each margin its first token
        if steps <= 0:
            engine.submit(QueryPrefill(job), now)
            return
        job.margins_left = job.margins
        context = job.work.document_tokens + profile.margin_prompt_tokens + 1
        engine.decode(job, job.margins, steps, context)


@dataclass(eq=False)
class QueryPrefill:
    job: Job

    def begin(self, engine: Engine) -> float:
        return self.job.query_prefill_seconds(engine.profile)

    def finish(self, engine: Engine, now: float) -> None:
        work = self.job.work
        context = work.document_tokens + self.job.request.query_tokens
        self.job.first_token(engine, now, context + self.job.margins * work.margin_tokens + 1)
