"""The answer started beside the last margins (`answer_early`), against the scripted fake
engine: when an early answer stands, when a margin makes it give way, and what the final
prompt holds either way."""

from __future__ import annotations

import itertools

import pytest

from tests.fakes.engine import (
    FakeBackend,
    Script,
    options,
)
from tests.wim.test_orchestrator import collect, requests
from wim_service.wim.backend import (
    GenerationParams,
    RequestKind,
)
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.prompts import MarginNote, PromptBuilder

LAST = "Sentence 59 is about the harbour and its boats."  # grounded in the last segment only


def answer_script(last_margin: str) -> Script:
    """Margins that ground nowhere but in the last segment (if `last_margin` is LAST); each
    answer request says which one it is."""
    answers = itertools.count(1)

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.ANSWER:
            return f"Answer number {next(answers)} here."
        return last_margin

    return script


def answer_events_follow_margins(events: list) -> str:
    kinds = [e.type for e in events]
    assert kinds.index("answer") > max(i for i, k in enumerate(kinds) if k == "margin")
    return "".join(e.text for e in events if e.type == "answer")


async def test_an_answer_started_beside_a_dropped_last_margin_stands(tokenizer) -> None:
    backend = FakeBackend(tokenizer, answer_script("Sentence 99 is about the harbour."))
    events = await collect(backend)
    done = events[-1]
    assert done.type == "done", done
    assert not any(e.kept for e in events if e.type == "margin")
    # One answer request, over the plain final prompt, started before the last margin ended.
    answers = [r for r in backend.requests if r.kind is RequestKind.ANSWER]
    builder = PromptBuilder(tokenizer, options().prompts)
    assert [r.suffix for r in answers] == [builder.final_suffix("Where is the gate?", [])]
    (answer,) = requests(backend.log, RequestKind.ANSWER)
    last_margin = requests(backend.log, RequestKind.MARGIN)[-1]
    assert answer.start < last_margin.end
    # Its text is held back until the last margin is decided, then streamed whole.
    assert answer_events_follow_margins(events) == "Answer number 1 here."
    assert done.answer == "Answer number 1 here." and done.usage.discarded_answer_tokens == 0
    assert backend.contexts[0].concluded == 0 and backend.reserved_blocks == 0


async def test_a_kept_last_margin_discards_the_early_answer(tokenizer) -> None:
    backend = FakeBackend(tokenizer, answer_script(LAST))
    events = await collect(backend)
    done = events[-1]
    assert done.type == "done", done
    kept = [e.segment for e in events if e.type == "margin" and e.kept]
    assert kept == [done.usage.segments - 1] == done.notes
    builder = PromptBuilder(tokenizer, options().prompts)
    answers = [r for r in backend.requests if r.kind is RequestKind.ANSWER]
    assert [r.suffix for r in answers] == [
        builder.final_suffix("Where is the gate?", []),
        builder.final_suffix("Where is the gate?", [MarginNote(kept[0], LAST)]),
    ]
    # The second answer is appended to the context; only its text reaches the client, and
    # the first one's tokens are booked as discarded.
    assert backend.contexts[0].concluded == 1
    assert answer_events_follow_margins(events) == "Answer number 2 here."
    early = len(tokenizer.encode_user_text("Answer number 1 here.").ids)
    assert 0 < done.usage.discarded_answer_tokens <= early
    # Both answers' prompts are booked as computed (the fake caches every context token).
    computed = len(backend.contexts[0].ids) + sum(len(r.suffix) for r in backend.requests)
    assert done.usage.prompt_tokens_computed == computed


@pytest.mark.parametrize("as_expected", [True, False], ids=["copies", "strays"])
async def test_an_answer_over_the_expected_notes_starts_beside_the_margins(
    tokenizer, as_expected: bool
) -> None:
    """With snapping, a second early answer adds the sentence each running margin is expected
    to copy. Only the last segment holds all of the question (skipped elsewhere); its margin
    copies LAST, and that answer stands, or strays, and the one without notes stands."""
    query = "What is sentence 59 about?"
    backend = FakeBackend(tokenizer, answer_script(LAST if as_expected else "Sentence 99."))
    events = await collect(backend, query, options(note_min_query_overlap=1.0))
    done = events[-1]
    assert done.type == "done", done
    written = [e.segment for e in events if e.type == "margin" and not e.skipped]
    assert written == [done.usage.segments - 1]
    builder = PromptBuilder(tokenizer, options().prompts)
    note = MarginNote(written[0], LAST, rank=1.0)
    answers = [r for r in backend.requests if r.kind is RequestKind.ANSWER]
    # Both start before the margin ends; no answer starts after it.
    assert [r.suffix for r in answers] == [
        builder.final_suffix(query, []),
        builder.final_suffix(query, [note]),
    ]
    last_margin = requests(backend.log, RequestKind.MARGIN)[-1]
    assert all(
        answer.start < last_margin.end for answer in requests(backend.log, RequestKind.ANSWER)
    )
    assert done.notes == ([written[0]] if as_expected else [])
    standing = "Answer number 2 here." if as_expected else "Answer number 1 here."
    assert answer_events_follow_margins(events) == standing == done.answer
    discarded = len(tokenizer.encode_user_text("Answer number 1 here.").ids)
    assert 0 < done.usage.discarded_answer_tokens <= discarded
    assert backend.contexts[0].concluded == 0 and backend.reserved_blocks == 0


CODES = {20: 1111, 35: 2222, 50: 3333}  # sentence number -> the gate code planted there


CODED = " ".join(
    f"The gate code is {CODES[i]}." if i in CODES else f"Sentence {i} is about the harbour."
    for i in range(60)
)


GATE_QUERY = "What is the gate code?"


async def gate_code_job(tokenizer, margins: dict[int, str]) -> tuple[FakeBackend, list, list]:
    """A job over CODED whose margins are given by the code their segment holds
    (`margins[code]`, or a copy of its sentence), and whose answers say which one they are.
    The engine holds every token until the first answer starts: the margins and the answers
    then run side by side. Returns the backend, the events and the written margins."""
    answers = itertools.count(1)

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.ANSWER:
            backend.gate.set()
            return f"Answer number {next(answers)} here, and it takes its time to say so."
        read = tokenizer.decode(backend.contexts[-1].ids[:prefix])
        code = int(read.rsplit("The gate code is ", 1)[1][:4])
        return margins.get(code, f"The gate code is {code}.")

    backend = FakeBackend(tokenizer, script)
    backend.gate.clear()
    opts = options(note_min_query_overlap=1.0)
    events = [e async for e in run_wim(backend, tokenizer, CODED, GATE_QUERY, opts)]
    assert events[-1].type == "done", events[-1]
    written = sorted(
        (e for e in events if e.type == "margin" and not e.skipped), key=lambda m: m.segment
    )
    assert answer_events_follow_margins(events) == events[-1].answer
    assert backend.contexts[0].concluded == 0 and backend.reserved_blocks == 0
    return backend, events, written


def answer_suffixes(backend: FakeBackend) -> list[list[int]]:
    return [r.suffix for r in backend.requests if r.kind is RequestKind.ANSWER]


def final_suffix(tokenizer, codes_by_segment: dict[int, int]) -> list[int]:
    """The final prompt over the gate-code notes of these segments."""
    notes = [MarginNote(s, f"The gate code is {c}.", 1.0) for s, c in codes_by_segment.items()]
    return PromptBuilder(tokenizer, options().prompts).final_suffix(GATE_QUERY, notes)


def answer_timeline(backend: FakeBackend) -> list[tuple[str, str, bool | None]]:
    """The engine's timeline after the last push: (start|end, kind, finished if an end).
    Every answer reads the same prefix, so they are told apart by order."""
    last_push = max(i for i, entry in enumerate(backend.log) if entry[0] == "extend-done")
    return [
        (entry[0], entry[1], entry[3] == entry[4] if entry[0] == "end" else None)
        for entry in backend.log[last_push + 1 :]
    ]


def no_answer_starts_after_the_margins(backend: FakeBackend) -> bool:
    timeline = answer_timeline(backend)
    last = max(i for i, entry in enumerate(timeline) if entry[:2] == ("end", "margin"))
    return ("start", "answer", None) not in timeline[last:]


async def test_early_answers_give_way_as_soon_as_a_margin_refutes_them(tokenizer) -> None:
    """Three margins still run when the answers start: the first strays, which refutes the
    answer over the expected notes, and the answer over what is expected then starts at
    once; the second is kept, which refutes the one without notes. Each is stopped right
    then, not after the last margin; the last margin copies its sentence as expected, so the
    answer started when the first strayed stands: no answer starts after the margins. (The
    last margin's sentence is the longest: margins run in lock-step on the fake engine.)"""
    backend, events, written = await gate_code_job(
        tokenizer, {1111: "Boats.", 3333: "The gate code is 3333 and the gate code is 3333."}
    )
    assert [m.kept for m in written] == [False, True, True]
    first, second, third = (m.segment for m in written)
    assert answer_suffixes(backend) == [
        final_suffix(tokenizer, {}),
        final_suffix(tokenizer, {first: 1111, second: 2222, third: 3333}),
        # Started when the first margin strayed, over the notes still expected then.
        final_suffix(tokenizer, {second: 2222, third: 3333}),
    ]
    assert answer_timeline(backend)[:8] == [
        ("start", "margin", None),
        ("start", "answer", None),
        ("start", "answer", None),
        ("end", "margin", True),  # strays: the answer over the expected notes is refuted
        ("end", "answer", False),
        ("start", "answer", None),
        ("end", "margin", True),  # kept: the answer over no notes is refuted
        ("end", "answer", False),
    ]
    assert no_answer_starts_after_the_margins(backend)
    done = events[-1]
    assert done.notes == [second, third]
    assert done.answer == "Answer number 3 here, and it takes its time to say so."
    assert done.usage.discarded_answer_tokens > 0


async def test_an_answer_gives_way_once_a_running_margin_strays_from_its_note(tokenizer) -> None:
    """The second margin writes at length about something else: once the first margin ends
    (as expected), the answer over the expected notes is discarded for what the second has
    written so far, not when it ends, and the answer over the first and third notes starts
    then. It stands; the engine runs no answer after the last margin."""
    stray = "Boats and ships and cranes and gulls and nets fill the busy harbour every day."
    backend, events, written = await gate_code_job(
        tokenizer, {2222: stray, 3333: "The gate code is 3333 and the gate code is 3333."}
    )
    assert [m.kept for m in written] == [True, False, True]
    first, second, third = (m.segment for m in written)
    assert answer_suffixes(backend) == [
        final_suffix(tokenizer, {}),
        final_suffix(tokenizer, {first: 1111, second: 2222, third: 3333}),
        # Both refuted when the first margin ended: the one without notes by its note, the
        # other by the second margin's draft. The second is expected to keep nothing now.
        final_suffix(tokenizer, {first: 1111}),
        final_suffix(tokenizer, {first: 1111, third: 3333}),
    ]
    timeline = answer_timeline(backend)
    first_end = next(i for i, entry in enumerate(timeline) if entry[:2] == ("end", "margin"))
    assert timeline[first_end + 1 : first_end + 5] == [
        ("end", "answer", False),
        ("end", "answer", False),
        ("start", "answer", None),
        ("start", "answer", None),
    ]
    assert no_answer_starts_after_the_margins(backend)
    done = events[-1]
    assert done.notes == [first, third]
    assert done.answer == "Answer number 4 here, and it takes its time to say so."


async def test_answer_early_off_answers_after_the_last_margin(tokenizer) -> None:
    backend = FakeBackend(tokenizer, answer_script("Sentence 99 is about the harbour."))
    events = await collect(backend, opts=options(answer_early=False))
    assert events[-1].type == "done", events[-1]
    (answer,) = requests(backend.log, RequestKind.ANSWER)
    assert answer.start > max(m.end for m in requests(backend.log, RequestKind.MARGIN))
    assert backend.contexts[0].concluded == 1
