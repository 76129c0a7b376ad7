"""Early answers, driven directly: which start, which give way, which one stands."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.engine import DOC, FakeBackend, FakeContext, options
from wim_service.wim.early import EarlyAnswers
from wim_service.wim.options import GroundingMode
from wim_service.wim.pinned import PinnedDocument
from wim_service.wim.plan import plan_document
from wim_service.wim.prompts import MarginNote, PromptBuilder
from wim_service.wim.query import QueryRoom, QueryRun

QUERY = "Where is the harbour?"  # every sentence of DOC holds all of it


class Margins:
    """Margin tasks that end when the test says so."""

    def __init__(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        self.outcomes: list[asyncio.Future[MarginNote | None]] = [
            loop.create_future() for _ in range(count)
        ]
        self.tasks = [asyncio.create_task(self._margin(f)) for f in self.outcomes]

    @staticmethod
    async def _margin(outcome: asyncio.Future[MarginNote | None]) -> MarginNote | None:
        return await outcome

    async def end(self, segment: int, note: MarginNote | None) -> None:
        self.outcomes[segment].set_result(note)
        await asyncio.sleep(0)  # the margin's task ends
        await asyncio.sleep(0)


def setup(tokenizer, blocks: int = 1000, **kw) -> tuple[PinnedDocument, QueryRun]:
    opts = options(note_min_query_overlap=0.8, **kw)
    backend = FakeBackend(tokenizer, script=lambda params, prefix: "The harbour is north.")
    builder = PromptBuilder(tokenizer, opts.prompts)
    plan = plan_document(builder, DOC, opts, backend.limits)
    assert len(plan.segments) >= 3
    document = PinnedDocument.of(builder, plan, FakeContext(backend), backend.limits)
    room = QueryRoom(plan.shape(builder, opts, QUERY), blocks)
    return document, QueryRun(QUERY, opts, lambda _: None, room, started=0.0)


def expected(document: PinnedDocument, segment: int) -> MarginNote:
    text, overlap = document.segment_texts[segment].closest_sentence(QUERY)
    return MarginNote(segment, text, rank=overlap)


async def test_none_start_without_running_margins_or_when_off(tokenizer) -> None:
    document, run = setup(tokenizer, answer_early=False)
    margins = Margins(len(document.plan.segments))
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    assert early.running == []  # answer_early off
    document, run = setup(tokenizer)
    for segment in range(len(margins.tasks)):
        await margins.end(segment, None)
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    assert early.running == []  # every margin ended: the answer starts as usual
    assert await early.await_margins() == []


async def test_a_failing_margin_starts_none(tokenizer) -> None:
    document, run = setup(tokenizer)
    margins = Margins(len(document.plan.segments))
    margins.outcomes[0].set_exception(RuntimeError("engine"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    assert early.running == []
    waiting = asyncio.create_task(early.await_margins())
    for segment in range(1, len(margins.tasks)):
        await margins.end(segment, None)
    with pytest.raises(RuntimeError):
        await waiting  # the failure, once every margin has ended


async def test_the_guess_stands_when_the_margin_gives_it(tokenizer) -> None:
    document, run = setup(tokenizer)
    last = len(document.plan.segments) - 1
    margins = Margins(last + 1)
    for segment in range(last):
        await margins.end(segment, None)
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    guess = expected(document, last)
    plain, guessed = early.running  # the kept notes alone, then with the guess
    assert plain.assumes == {last: None} and guessed.assumes == {last: guess.text}
    assert plain.suffix == document.final_suffix(QUERY, [], run.options)[0]
    assert guessed.suffix == document.final_suffix(QUERY, [guess], run.options)[0]
    waiting = asyncio.create_task(early.await_margins())
    await margins.end(last, guess)
    assert await waiting == [guess]
    assert early.running == [guessed]  # the plain one was refuted and discarded
    assert plain.task.cancelled() or plain.task.done()
    assert early.standing(guessed.suffix) is guessed
    assert early.standing(plain.suffix) is None
    await early.discard_all_but(guessed)
    assert not guessed.task.cancelled()
    assert (await guessed.task).text == "The harbour is north."
    assert plain.task.cancelled()
    assert early.tasks == [guessed.task]


async def test_an_answer_gives_way_to_a_draft_that_strays(tokenizer) -> None:
    document, run = setup(tokenizer)
    count = len(document.plan.segments)
    margins = Margins(count)
    for segment in range(count - 2):
        await margins.end(segment, None)
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    assert len(early.running) == 2
    # The last margin writes a number its expected sentence lacks: the guess is off.
    run.drafts[count - 1] = "Sentence 9999 "
    waiting = asyncio.create_task(early.await_margins())
    await asyncio.sleep(0)
    await margins.end(count - 2, expected(document, count - 2))
    for _ in range(10):  # the discarded answers' tasks unwind
        await asyncio.sleep(0)
    # Both were refuted or strayed; the answer over what is expected now starts alone.
    assert [answer.assumes for answer in early.running] == [{count - 1: None}]
    run.drafts.pop(count - 1)
    await margins.end(count - 1, None)
    assert await waiting == [expected(document, count - 2)]
    (standing,) = early.running
    final = document.final_suffix(QUERY, [expected(document, count - 2)], run.options)[0]
    assert early.standing(final) is standing
    before = run.ledger.discarded_answer_tokens
    await early.discard_all_but(None)
    assert standing.task.done()
    written = sum(len(chunk.token_ids) for chunk in standing.chunks)
    assert written > 0 and run.ledger.discarded_answer_tokens == before + written


async def test_no_room_no_early_answer(tokenizer) -> None:
    document, run = setup(tokenizer, blocks=0)
    margins = Margins(len(document.plan.segments))
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    assert early.running == []
    for task in margins.tasks:
        task.cancel()


async def test_without_snapping_nothing_is_guessed(tokenizer) -> None:
    document, run = setup(tokenizer, grounding=GroundingMode.CHECK)
    count = len(document.plan.segments)
    margins = Margins(count)
    for segment in range(count - 1):
        await margins.end(segment, None)
    early = EarlyAnswers(document, run, margins.tasks)
    early.start()
    # The guess would be the plain answer's final prompt: one answer, not two.
    assert [answer.assumes for answer in early.running] == [{count - 1: None}]
    waiting = asyncio.create_task(early.await_margins())
    await asyncio.sleep(0)
    await margins.end(count - 1, MarginNote(count - 1, "The harbour.", rank=1.0))
    assert await waiting == [MarginNote(count - 1, "The harbour.", rank=1.0)]
    assert early.running == []  # refuted: the margin kept a note
