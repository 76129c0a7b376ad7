"""The WiM loop against a scripted fake engine: relevance, stops, errors, cancellation."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tests.fakes.engine import (
    DOC,
    ENGINE_TRACEBACK,
    FakeBackend,
    options,
    steps,
)
from wim_service.wim.backend import (
    GenerationChunk,
    GenerationParams,
    PromptCost,
    RequestKind,
    StoredDocument,
)
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import GroundingMode, RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import open_document, run_wim
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.streams import consume


@dataclass(frozen=True)
class Span:
    """When something ran, as positions in the backend's log."""

    start: int
    end: int
    context_tokens: int  # pushes: the context's length after it; requests: the prefix read
    sent: int = 0
    total: int = 0

    def overlaps(self, other: Span) -> bool:
        return self.start < other.end and other.start < self.end


def pushes(log: list[tuple]) -> list[Span]:
    starts = [i for i, e in enumerate(log) if e[0] == "extend-start"]
    dones = [(i, e[1]) for i, e in enumerate(log) if e[0] == "extend-done"]
    return [Span(s, d, n) for s, (d, n) in zip(starts, dones, strict=False)]


def requests(log: list[tuple], kind: RequestKind) -> list[Span]:
    """Spans of the requests of one kind, in start order (a request never ended has end -1)."""
    spans = []
    for i, entry in enumerate(log):
        if entry[:2] == ("start", kind.value):
            end = next(
                (j for j in range(i + 1, len(log)) if log[j][:3] == ("end", *entry[1:])), None
            )
            sent, total = log[end][3:] if end is not None else (0, 0)
            spans.append(Span(i, -1 if end is None else end, entry[2], sent, total))
    return spans


def max_in_flight(spans: list[Span]) -> int:
    return max(sum(s.start <= t < s.end for s in spans) for t in {s.start for s in spans})


def assert_request_params(backend: FakeBackend, opts: WiMOptions) -> None:
    """Each request asks for what the options say: token limits, stop ids, YES/NO first."""
    tokenizer = backend.tokenizer
    yes, no = PromptBuilder(tokenizer, opts.prompts).relevance_token_ids()
    first_token = opts.relevance is RelevanceMode.FIRST_TOKEN
    assert backend.requests
    for request in backend.requests:
        params = request.params
        assert params.stop_token_ids == tokenizer.eos_token_ids
        if request.kind is RequestKind.MARGIN:
            assert params.max_tokens == opts.margin_max_tokens
            assert params.first_token_ids == (yes | no if first_token else None)
        elif request.kind is RequestKind.ANSWER:
            assert params.max_tokens == opts.answer_max_tokens
            assert params.first_token_ids is None


async def collect(backend, query="Where is the gate?", opts=None, **kw) -> list:
    return [
        e async for e in run_wim(backend, backend.tokenizer, DOC, query, opts or options(), **kw)
    ]


@pytest.mark.parametrize("relevance", [RelevanceMode.NONE, RelevanceMode.FIRST_TOKEN])
async def test_a_margin_ends_after_its_first_sentence(tokenizer, relevance) -> None:
    """margin_max_sentences (default 1): the margin stops once its second sentence begins
    (in first-token mode, counted without its YES), its request is cut there, and the token
    that began the second sentence is not part of it; without a limit it runs to its end."""
    first = "The harbour has boats."
    rest = " The boats are in the harbour, and the gate is by the quay."
    yes = "YES. " if relevance is RelevanceMode.FIRST_TOKEN else ""

    def script(params: GenerationParams, prefix: int) -> str:
        return "Done." if params.kind is RequestKind.ANSWER else yes + first + rest

    for limit in (1, None):
        backend = FakeBackend(tokenizer, script)
        opts = options(relevance=relevance, margin_max_sentences=limit)
        events = await collect(backend, opts=opts)
        assert events[-1].type == "done", events[-1]
        margins = [e for e in events if e.type == "margin"]
        assert len(margins) == events[-1].usage.segments > 1
        assert {m.text for m in margins} == {first if limit else first + rest}
        ends = [entry[3:] for entry in backend.log if entry[:2] == ("end", "margin")]
        assert len(ends) == len(margins)
        assert all((sent < total) is (limit == 1) for sent, total in ends)


async def test_first_token_no_drops_the_margin_at_its_first_token(tokenizer) -> None:
    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.MARGIN:
            return "YES: The gate is on Salt Lane." if prefix % 2 else "NO, nothing here at all."
        return "On Salt Lane."

    backend = FakeBackend(tokenizer, script)
    first_token = options(relevance=RelevanceMode.FIRST_TOKEN)
    events = await collect(backend, opts=first_token)
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
    timings = events[-1].timings
    assert 0 <= timings.queue_s < timings.total_s < 60  # admission was immediate
    assert 0 < timings.answer_ttft_s <= timings.total_s
    assert all(0 <= m.elapsed_s < timings.total_s for m in margins)
    # The answer streamed as it was written, and the deltas make up the answer.
    assert "".join(e.text for e in events if e.type == "answer") == events[-1].answer
    assert_request_params(backend, first_token)


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
    assert len(margins) == events[-1].usage.segments > 1
    assert all(m.text == "Fact one." and m.relevant for m in margins)
    spans = requests(backend.log, RequestKind.MARGIN)
    assert len(spans) == len(margins)
    assert all(0 < span.sent < span.total for span in spans)
    assert_request_params(backend, options(relevance=RelevanceMode.NONE))


async def test_classifier_mode_asks_a_separate_turn(tokenizer) -> None:
    verdicts = iter(["YES", "NO"] * 50)

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.CLASSIFIER:
            assert params.max_tokens == 1 and params.first_token_ids
            assert params.stop_token_ids == tokenizer.eos_token_ids
            return next(verdicts)
        return "Some fact." if params.kind is RequestKind.MARGIN else "Answer."

    backend = FakeBackend(tokenizer, script, concurrent=False)
    events = await collect(backend, opts=options(relevance=RelevanceMode.CLASSIFIER))
    margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
    assert [m.relevant for m in margins] == [i % 2 == 0 for i in range(len(margins))]
    # Usage accounts for every request: the context, margins, classifier turns, the answer.
    usage, context = events[-1].usage, backend.contexts[0]
    assert [r.kind for r in backend.requests].count(RequestKind.CLASSIFIER) == len(margins)
    assert usage.prompt_tokens_submitted == len(context.ids) + sum(
        r.prefix + len(r.suffix) for r in backend.requests
    )
    assert usage.prompt_tokens_cached == sum(r.prefix for r in backend.requests) > 0
    assert (
        usage.prompt_tokens_computed == usage.prompt_tokens_submitted - usage.prompt_tokens_cached
    )
    # At least once: the context, each margin/classifier instruction, the final prompt.
    assert usage.minimal_prompt_tokens == len(context.ids) + sum(
        len(r.suffix) for r in backend.requests
    )
    written = {
        kind: sum(s.sent for s in requests(backend.log, kind))
        for kind in (RequestKind.MARGIN, RequestKind.CLASSIFIER, RequestKind.ANSWER)
    }
    assert usage.margin_tokens == written[RequestKind.MARGIN] + written[RequestKind.CLASSIFIER]
    assert usage.answer_tokens == written[RequestKind.ANSWER] > 0
    assert context.concluded == 1  # a one-shot job appends its final prompt to the context


@pytest.mark.parametrize("pipelined", [True, False])
async def test_margin_i_is_in_flight_while_segment_i_plus_1_is_pushed(
    tokenizer, pipelined: bool
) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES a fact about boats.")
    await collect(backend, pipelined=pipelined)
    segments, margins = pushes(backend.log), requests(backend.log, RequestKind.MARGIN)
    assert len(segments) == len(margins) >= 3
    by_context = {m.context_tokens: m for m in margins}
    for this, following in itertools.pairwise(segments):
        margin = by_context[this.context_tokens]  # the margin of `this` segment
        assert margin.start > this.end  # submitted once its segment is in
        if pipelined:
            assert margin.overlaps(following)
        else:
            # One after another: each margin ends before the next segment is pushed.
            assert margin.end < following.start


async def test_engine_failure_becomes_an_error_event_and_closes(tokenizer, caplog) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES x", fail_on=RequestKind.ANSWER)
    events = await collect(backend)
    assert events[-1].type == "error" and events[-1].code == ErrorCode.ENGINE_ERROR.value
    assert backend.contexts[0].closed
    # The client is told what failed and under which incident; the exception's text (paths,
    # a traceback) is in the server log only, under that incident.
    message = events[-1].message
    assert message.startswith("the engine failed on this job (incident ")
    assert "Traceback" not in message and "/srv/" not in message
    incident = message.removesuffix(" in the server log)").rsplit(" ", 1)[1]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert len(logged) == 1 and str(logged[0].exc_info[1]) == ENGINE_TRACEBACK


async def test_consumer_leaving_stops_the_job_and_leaves_nothing_behind(tokenizer) -> None:
    def script(params: GenerationParams, prefix: int) -> str:
        return "YES " + "word " * 30 if params.kind is RequestKind.MARGIN else "Salt Lane."

    full = FakeBackend(tokenizer, script)
    full_events = await collect(full)
    assert full_events[-1].type == "done"

    backend = FakeBackend(tokenizer, script)
    backend.gate.clear()  # margins stall after submission: they are in flight at the cancel
    events = []
    stream = run_wim(backend, tokenizer, DOC, "Where is the gate?", options())
    async for event in stream:
        events.append(event)
        if event.type == "segment" and event.segment == 1:
            break
    await stream.aclose()  # returns once the job task has finished its clean-up
    # Stopped early: fewer segments pushed than the document has, no answer requested.
    assert len(pushes(backend.log)) < len(pushes(full.log))
    assert requests(backend.log, RequestKind.ANSWER) == []
    assert len(events) < len(full_events)
    # The margins in flight were aborted, not left running.
    margins = requests(backend.log, RequestKind.MARGIN)
    assert margins and all(m.end > m.start and m.sent < m.total for m in margins)
    # Nothing left behind: the context is closed and its reservation released.
    assert backend.contexts[0].closed and backend.reserved_blocks == 0


@pytest.mark.parametrize("concurrent", [False, True])
async def test_document_session_margins_one_at_a_time_without_concurrent_branches(
    tokenizer, concurrent: bool
) -> None:
    backend = FakeBackend(
        tokenizer, lambda p, prefix: "YES a fact about boats.", concurrent=concurrent
    )
    session = await open_document(backend, tokenizer, DOC, options())
    try:
        events = [e async for e in session.query("Where is the gate?")]
    finally:
        await session.close()
    assert events[-1].type == "done", events[-1]
    margins = requests(backend.log, RequestKind.MARGIN)
    assert len(margins) == events[-1].usage.segments > 1
    assert all(m.end > m.start for m in margins)
    # A backend without concurrent branches never has two margins in flight; one with them
    # gets every margin at once.
    assert max_in_flight(margins) == (len(margins) if concurrent else 1)
    assert backend.reserved_blocks == 0


@pytest.mark.parametrize("room_for_both", [True, False])
async def test_queries_on_one_session_run_side_by_side_when_the_engine_has_room(
    tokenizer, room_for_both: bool
) -> None:
    """Two queries at once on one document session: the second runs beside the first in
    blocks of its own if the engine has them free, else it waits for the session's."""
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES a fact about boats.")
    session = await open_document(backend, tokenizer, DOC, options())
    context = backend.contexts[0]
    if not room_for_both:
        backend.capacity_blocks = backend.reserved_blocks  # the session's own, nothing more
    try:
        results = await asyncio.gather(
            *(collect_query(session, q) for q in ("Where is the gate?", "Who keeps the boats?"))
        )
        assert [events[-1].type for events in results] == ["done", "done"], results
        margins = requests(backend.log, RequestKind.MARGIN)
        answers = requests(backend.log, RequestKind.ANSWER)
        per_query = len(margins) // 2
        first, second = margins[:per_query], margins[per_query:]
        if room_for_both:
            # The second query's margins start while the first's still run, in blocks of
            # its own (what it needs, less than the session's worst case); the first fits the
            # session's, so it reserves nothing more.
            assert second[0].start < max(m.end for m in first)
            assert context.extra_reserved[0] == 0 < context.extra_reserved[1]
            assert context.extra_reserved[1] <= session.query_blocks
        else:
            # In turn: the second's margins start after the first's last answer ends.
            assert second[0].start > max(a.end for a in answers[: len(answers) // 2])
            assert context.extra_reserved == [0, 0]
        assert backend.reserved_blocks == context.reserved_blocks
    finally:
        await session.close()
    assert backend.reserved_blocks == 0


async def test_closing_a_session_ends_every_query_on_it(tokenizer) -> None:
    """DELETE with two queries running side by side and one waiting: all three end with
    NOT_FOUND and every block comes back."""
    backend = FakeBackend(tokenizer, lambda p, prefix: "YES a fact about boats.")
    session = await open_document(backend, tokenizer, DOC, options())
    held = backend.reserved_blocks
    # Room beside the session's own for one of these short queries, not for two.
    backend.capacity_blocks = held + session.query_blocks // 2
    backend.gate.clear()  # generations stall: the queries stay running
    queries = [asyncio.create_task(collect_query(session, f"Question {i}?")) for i in range(3)]
    await steps(50)
    # One runs in the session's blocks, one beside it in its own, the third waits.
    extra = backend.contexts[0].extra_reserved
    assert session.busy and extra == [0, backend.reserved_blocks - held]
    await session.close()
    for events in await asyncio.gather(*queries):
        assert [(e.type, e.code) for e in events] == [("error", ErrorCode.NOT_FOUND.value)]
    assert not session.busy and backend.reserved_blocks == 0


async def collect_query(session, query: str) -> list:
    return [e async for e in session.query(query)]


@pytest.mark.parametrize(
    ("document", "query", "code"),
    [
        ("   ", "q?", ErrorCode.INVALID_INPUT),
        ("\x14", "q?", ErrorCode.INVALID_INPUT),  # no token: schemathesis found it a 500
        (DOC, " ", ErrorCode.INVALID_INPUT),
        (DOC * 5, "q?", ErrorCode.TOO_LONG),
    ],
)
async def test_bad_input_is_refused_before_engine_work(tokenizer, document, query, code) -> None:
    backend = FakeBackend(tokenizer, lambda p, prefix: "x")
    events = [e async for e in run_wim(backend, tokenizer, document, query, options())]
    assert [e.type for e in events] == ["error"] and events[0].code == code.value
    assert backend.contexts == []


async def test_document_session_answers_each_query_as_a_branch_with_its_notes(tokenizer) -> None:
    def script(params: GenerationParams, prefix: int) -> str:
        return "YES: the harbour has boats." if params.kind is RequestKind.MARGIN else "Here."

    backend = FakeBackend(tokenizer, script)
    opts = options(grounding=GroundingMode.OFF)  # every YES margin becomes a note
    session = await open_document(backend, tokenizer, DOC, opts)
    context = backend.contexts[0]
    read = len(context.ids)
    builder = PromptBuilder(tokenizer, opts.prompts)
    # The short query's reservation holds its margins and an answer at once, the long one's
    # (margins or answer, whichever is larger) does not: no answer starts early there.
    for query, answers_sent in (
        ("Where is the gate?", 2),
        ("Which boats are in the harbour today? " * 60, 1),
    ):
        backend.requests.clear()
        events = [e async for e in session.query(query)]
        done = events[-1]
        assert done.type == "done", done
        segments = done.usage.segments
        assert done.notes == sorted(e.segment for e in events if e.type == "margin" and e.kept)
        assert done.notes == list(range(segments))
        # Margins carry this query's instruction; the answer reads the whole document as a
        # branch, so the context stays the document for the next query.
        margins = [r for r in backend.requests if r.kind is RequestKind.MARGIN]
        assert [r.suffix for r in margins] == [builder.margin_suffix(query, opts.relevance)] * (
            segments
        )
        # All margins run at once; an answer started beside them with no note is discarded
        # when they are kept, and the answer over every note follows.
        answers = [r for r in backend.requests if r.kind is not RequestKind.MARGIN]
        assert [(r.kind, r.prefix) for r in answers] == [(RequestKind.ANSWER, read)] * answers_sent
        assert (answers[0].suffix == builder.final_suffix(query, [])) == (answers_sent == 2)
        assert (done.usage.discarded_answer_tokens > 0) == (answers_sent == 2)
        assert len(context.ids) == read and context.concluded == 0
        assert 0 < done.timings.margins_s <= done.timings.total_s
    # The short query fits the room reserved at open; the long one reserves more, for itself.
    assert context.extra_reserved[0] == 0 < context.extra_reserved[1]
    await session.close()
    assert backend.reserved_blocks == 0
    events = [e async for e in session.query("Where is the gate?")]
    assert [(e.type, e.code, e.message) for e in events] == [
        ("error", ErrorCode.NOT_FOUND.value, "the document session was closed (deleted or expired)")
    ]


async def _chunks(ids: list[int], size: int = 1) -> AsyncIterator[GenerationChunk]:
    """`ids` in chunks of `size` tokens (more than one: what a reader slower than the engine
    receives)."""
    for start in range(0, len(ids), size):
        last = start + size >= len(ids)
        yield GenerationChunk(
            ids[start : start + size], last, PromptCost(1, 0) if not start else None
        )


@pytest.mark.parametrize(
    ("written", "stop", "kept"),
    [
        ("The gate is on Salt Lane.", [], "The gate is on Salt Lane."),
        ("The gate.\n\nMore text after the stop.", ["\n\n"], "The gate."),
        ("A.\n\nB.\n\nC.", ["\n\n"], "A."),
        ("\n\nAll of it after the stop.", ["\n\n"], ""),
        ("Smile 🙂 now, 日本.", [], "Smile 🙂 now, 日本."),
        ("", [], ""),
    ],
)
async def test_streamed_text_stops_at_the_first_stop_string(
    tokenizer, written: str, stop: list[str], kept: str
) -> None:
    ids = tokenizer.encode_user_text(written).ids
    deltas: list[str] = []
    generated = await consume(_chunks(ids), tokenizer, stop=stop, on_text=deltas.append)
    assert generated.text == kept
    # The deltas are the kept text, in non-empty pieces, never a half character or a piece
    # of a stop string.
    assert "".join(deltas) == kept and all(deltas)
    assert not any("\ufffd" in d or "\n" in d for d in deltas)
    # Reading stops at the stop string (the request is then aborted).
    assert (generated.token_ids == ids) == (not stop)
    if not stop and kept.isascii():
        # Nothing to hold back: each token's text goes out as soon as it arrives.
        assert deltas == [
            tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :]
            for i in range(len(ids))
        ]


@pytest.mark.parametrize("size", [2, 3, 7, 100])
async def test_where_a_generation_gives_up_does_not_depend_on_how_its_tokens_arrive(
    tokenizer, size: int
) -> None:
    """A margin that names 212,000 stops on the token after it, whether the tokens come one
    by one or several per chunk; the tokens received after that are still counted."""
    ids = tokenizer.encode_user_text("The ferry carried 212,000 passengers. It sailed daily.").ids

    def give_up(text: str) -> bool:
        return "212,000 " in text

    alone = await consume(_chunks(ids), tokenizer, stop=["\n\n"], give_up=give_up)
    merged = await consume(_chunks(ids, size), tokenizer, stop=["\n\n"], give_up=give_up)
    assert alone.text.startswith("The ferry carried 212,000 pass") and "." not in alone.text
    assert merged.text == alone.text
    assert merged.token_ids == ids[: len(merged.token_ids)]
    assert len(merged.token_ids) >= len(alone.token_ids)


# -- the answer started beside the last margins (answer_early) ---------------------------------


async def test_a_stored_document_is_restored_in_one_push_and_answers_as_read(tokenizer) -> None:
    """A document session opened for a stored document on a second engine (here: a second
    context of the same store) loads the first one's pushes in one push instead of reading
    segment by segment, emits the same segment events, and answers the same."""
    backend = FakeBackend(tokenizer, lambda params, prefix: "YES the harbour.")
    key = StoredDocument("acme", "doc-1")
    read_events: list[WiMEvent] = []
    first = await open_document(
        backend, tokenizer, DOC, options(), emit=read_events.append, stored=key
    )
    assert first.restored.fallback == "missing" and backend.saved[key] == backend.contexts[0].ids
    pushes = sum(e[0] == "extend-done" for e in backend.log)
    restored_events: list[WiMEvent] = []
    second = await open_document(
        backend, tokenizer, DOC, options(), emit=restored_events.append, stored=key
    )
    assert second.restored.restored_tokens == len(backend.contexts[0].ids)
    assert sum(e[0] == "extend-done" for e in backend.log) == pushes  # nothing computed
    assert restored_events == read_events
    answers = [
        [e async for e in session.query("Where is the gate?")][-1] for session in (first, second)
    ]
    assert [a.type for a in answers] == ["done", "done"] and answers[0].answer == answers[1].answer
    # Another tenant's key (or other tokens) restores nothing: the document is read.
    other = await open_document(
        backend, tokenizer, DOC, options(), stored=StoredDocument("globex", "doc-1")
    )
    assert other.restored.fallback == "missing" and not other.restored.holds_document
    assert other.context.context_tokens == second.context.context_tokens
