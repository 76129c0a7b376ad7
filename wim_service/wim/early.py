"""Answers started early: beside the last margins, over the notes they are expected to give.

When the last segment is in, the last margins are still decoding. `EarlyAnswers` starts the
answer at once, as branches beside them with its text held back: over the notes kept so far
and, with snapping, over those plus the note each running margin is expected to give (the note
policy's `expected_note`). Each time a margin ends, an answer that assumed otherwise, or that
expects a note a running margin has strayed from, is discarded, and the answer over what is
expected by then starts. The one whose final prompt is the one every note makes stands; a wrong
guess costs time, never a wrong answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from wim_service.wim.backend import GenerationChunk
from wim_service.wim.pinned import PinnedDocument
from wim_service.wim.prompts import MarginNote
from wim_service.wim.query import Ledger, QueryRun
from wim_service.wim.streams import Generated, HeldText, consume, recorded

MarginTasks = list[asyncio.Task[MarginNote | None]]  # one per segment, in segment order


def _note_text(note: MarginNote | None) -> str | None:
    """What a margin's outcome puts in the final prompt: its note's text, or nothing."""
    return note.text if note is not None else None


@dataclass
class EarlyAnswer:
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

    async def discard(self, ledger: Ledger) -> None:
        """Stop it (a later note changed the final prompt) and book the work it did."""
        self.task.cancel()
        await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.exception()  # an early answer that failed is as moot as one that did not
        cost = next((chunk.cost for chunk in self.chunks if chunk.cost is not None), None)
        # Its final prompt counts as minimal too: the request was meant, not a cache miss.
        ledger.add(cost, minimal=len(self.suffix) if cost is not None else 0)
        ledger.discarded_answer_tokens += sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass
class _Forecast:
    """Where the margins of a query stand while some still run."""

    known: list[MarginNote]  # the notes of the margins that ended
    guessed: list[MarginNote]  # the notes the running margins are expected to give
    running: list[int]  # the segments whose margin still runs
    pending: int  # running margins that will hold KV (a skipped one holds none)


class EarlyAnswers:
    """The early answers of one query; `running` holds those that may still stand."""

    def __init__(self, document: PinnedDocument, run: QueryRun, margins: MarginTasks) -> None:
        self.document = document
        self.run = run
        self.margins = margins
        self.running: list[EarlyAnswer] = []

    def start(self) -> None:
        """Start the answers worth starting beside the margins still running, if any are and
        the query's room holds them together with the answers already running: the one over
        the notes kept so far plus those the running margins are expected to give and, while
        no answer runs, the one over the kept notes alone, in case the running margins keep
        nothing. An answer over a final prompt that a running one already has is not started
        twice. At most one final prompt is the one the margins' notes make."""
        done = [task for task in self.margins if task.done()]
        if not self.run.options.answer_early or len(done) == len(self.margins):
            return
        if any(task.cancelled() or task.exception() is not None for task in done):
            return  # the job is failing: the answer raises it
        forecast = self._forecast()
        query, options = self.run.query, self.run.options
        nothing_kept: dict[int, str | None] = dict.fromkeys(forecast.running)
        versions = []
        if not self.running:
            known_suffix = self.document.final_suffix(query, forecast.known, options)[0]
            versions.append((known_suffix, nothing_kept))
        guessed_suffix = self.document.final_suffix(
            query, forecast.known + forecast.guessed, options
        )[0]
        versions.append(
            (guessed_suffix, nothing_kept | {note.segment: note.text for note in forecast.guessed})
        )
        suffixes = [answer.suffix for answer in self.running]
        fresh: list[tuple[list[int], dict[int, str | None]]] = []
        for suffix, assumes in versions:
            if suffix not in suffixes:
                suffixes.append(suffix)
                fresh.append((suffix, assumes))
        block = self.document.limits.block_size
        while fresh and not self.run.room.holds_early_answers(
            block, forecast.pending, [len(suffix) for suffix in suffixes]
        ):
            fresh.pop()  # the guess goes first
            suffixes.pop()
        self.running.extend(self._start(suffix, assumes) for suffix, assumes in fresh)

    def _forecast(self) -> _Forecast:
        """The notes known and expected, and the margins still running, at this moment."""
        forecast = _Forecast([], [], [], 0)
        run = self.run
        for segment, task in zip(self.document.plan.segments, self.margins, strict=True):
            if task.done():
                if (note := task.result()) is not None:
                    forecast.known.append(note)
                continue
            forecast.running.append(segment.index)
            segment_text = self.document.segment_texts[segment.index]
            if not run.policy.none_can_be_kept(segment_text, run.query):
                forecast.pending += 1
                draft = run.drafts.get(segment.index, "")
                note = run.policy.expected_note(segment_text, run.query, draft)
                if note is not None:
                    forecast.guessed.append(note)
        return forecast

    def _start(self, suffix: list[int], assumes: dict[int, str | None]) -> EarlyAnswer:
        """An answer over `suffix` as a branch beside the margins, its text held back."""
        chunks: list[GenerationChunk] = []
        text = HeldText()
        stream = self.document.answer_branch(suffix, self.run.options)
        task = asyncio.create_task(
            consume(
                recorded(stream, chunks),
                self.document.builder.tokenizer,
                stop=self.run.options.answer_stop,
                on_text=text,
            )
        )
        return EarlyAnswer(suffix, assumes, text, chunks, task)

    async def await_margins(self) -> list[MarginNote]:
        """The kept notes, once every margin has ended. Meanwhile, each time a margin ends, an
        early answer is discarded if that margin ended otherwise than it assumed, or if a
        margin still running has strayed from the note it expects of it (either would only
        slow the engine steps that the margins and the other answers share), and the answer
        over what is expected by then starts unless it runs already (`start`)."""
        segment_of = {task: index for index, task in enumerate(self.margins)}
        running = {task for task in self.margins if not task.done()}
        while running:
            ended, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            outcomes = [(segment_of[task], task.result()) for task in ended]  # raises a failure
            for answer in list(self.running):
                if any(
                    answer.refuted_by(segment, note) for segment, note in outcomes
                ) or not self._drafts_follow(answer):
                    self.running.remove(answer)
                    await answer.discard(self.run.ledger)
            if running:
                self.start()
        return [note for task in self.margins if (note := task.result()) is not None]

    def _drafts_follow(self, answer: EarlyAnswer) -> bool:
        """Whether every running margin that `answer` expects a note of may still give it."""
        policy, drafts = self.run.policy, self.run.drafts
        return all(
            note is None or policy.may_still_give(drafts.get(segment, ""), note)
            for segment, note in answer.assumes.items()
        )

    def standing(self, suffix: list[int]) -> EarlyAnswer | None:
        """The early answer over `suffix`, the final prompt the notes make, if one runs."""
        return next((answer for answer in self.running if answer.suffix == suffix), None)

    async def discard_all_but(self, standing: EarlyAnswer | None) -> None:
        """Discard every running answer but `standing`: their final prompts are not the one."""
        for answer in self.running:
            if answer is not standing:
                await answer.discard(self.run.ledger)

    @property
    def tasks(self) -> list[asyncio.Task[Generated]]:
        """The tasks of the answers not discarded while the margins ran (one may stand)."""
        return [answer.task for answer in self.running]
