"""Grounded margins: the check itself, snapping, the final step's note budget, do no harm."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.fakes.engine import FakeBackend, FakeContext
from wim_service.wim.backend import EngineLimits, GenerationParams, RequestKind, StoredDocument
from wim_service.wim.grounding import Claim, SegmentText, may_still_copy, query_overlap
from wim_service.wim.options import GroundingMode, PromptTemplates, RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.prompts import MarginNote, PromptBuilder
from wim_service.wim.segmentation import Segment

# -- the check ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harbor(report: str) -> SegmentText:
    return SegmentText(report, Segment(0, 0, 0, 0, len(report)))


@pytest.mark.parametrize(
    ("margin", "grounded"),
    [
        ("The access code for the night gate is 4417.", True),
        ("The new code is 4417", True),  # a paraphrase: fewer words, same value
        ("The port employs 1240 people.", True),  # "1,240" in the text: one number
        ("Tomas Reyes took over the pilot service from Margaret Oyelaran.", True),
        ("Forty-two apprentices trained, and a simulator for pilots was added.", True),
        # The README failure: an invented code, attributed to the asked-for gate.
        ("The access code for the night gate is 123456.", False),
        ("The access code for the night gate is 4471.", False),  # a near miss is another value
        ("Margaret Oyelaran retired after 31 years.", False),  # "thirty-one": not the number
        ("Tomas Reyez leads the pilot service.", False),  # names match exactly
        ("The new code is kept in the lighthouse stairs.", False),  # the invented fact
        ("The document does not state the access code.", False),  # a denial
        ("NO", False),
        ("", False),
    ],
)
def test_margins_are_checked_against_the_segment(harbor, margin: str, grounded: bool) -> None:
    verdict = harbor.ground(margin, min_coverage=0.8, max_sentences=2)
    assert verdict.grounded is grounded
    if grounded:
        evidence = verdict.evidence
        # The evidence is the document's own sentence(s), located by character span.
        assert harbor.document[evidence.char_start : evidence.char_end] == evidence.text
        assert evidence.text[0].isupper() and evidence.text.endswith(".")
        assert evidence.coverage >= 0.8


NIGHT_GATE = "What is the access code for the night gate?"


def hopeless(segment: SegmentText, partial: str, min_query_overlap: float = 0.0) -> bool:
    return segment.cannot_keep(
        partial, NIGHT_GATE, max_sentences=2, clears=lambda share: share >= min_query_overlap
    )


@pytest.mark.parametrize(
    ("partial", "verdict"),
    [
        ("The access code for the night gate is 123456 ", True),  # written, and not there
        ("The access code for the night gate is 123456", False),  # may still grow
        ("The port employs 1,", False),  # may become "1,240"
        ("The port employs 1,240 people", False),  # there
        ("Margaret Oyelaran retired after 31 years", True),
        ("Tomas Reyez leads", True),  # a name the segment lacks
        ("Tomas Reyes leads the pilot service", False),
        ("Reyez leads", False),  # a capitalised first word is not taken for a name
        ("The new code is kept in the lighthouse stairs", False),  # only coverage rules it out
        # Both are in the report, but no two consecutive sentences hold both.
        ("Tomas Reyes shares code 4417 ", True),
        ("Tomas Reyes took over from Margaret ", False),
    ],
)
def test_a_margin_is_hopeless_once_it_names_what_the_segment_lacks(
    harbor, partial: str, verdict: bool
) -> None:
    assert hopeless(harbor, partial) is verdict


@pytest.mark.parametrize(
    ("partial", "verdict"),
    [
        ("The new code is 4417 ", False),  # in the sentence that answers
        ("The port employs 1,240 people", True),  # in the report, far from the question
        ("Margaret Oyelaran retired", True),
        # The gate's own sentence, but it shares too little with the question to be a note.
        ("The night gate on Salt Lane is", True),
        ("The night gate on Salt", False),  # "Salt" may still grow: nothing named yet
        ("The access code for the night gate", False),  # no value yet: never hopeless
    ],
)
def test_a_margin_is_hopeless_once_it_names_what_only_sentences_far_from_the_query_hold(
    harbor, partial: str, verdict: bool
) -> None:
    """With snapping the note is the evidence, which must hold every value the margin names
    and share 0.8 of the query: values that only distant sentences hold end the margin."""
    assert hopeless(harbor, partial, min_query_overlap=0.8) is verdict
    # Without the query filter, only values the segment lacks end a margin.
    assert not hopeless(harbor, partial, min_query_overlap=0.0)


GATE = (
    "The access code for the night gate keypad was changed in September; the new code is "
    "4417, and only the duty guard and the harbour master may share it."
)
OFFICE = (
    "Questions about this report can be sent to the harbour office on the east quay, which is "
    "open on weekdays from eight in the morning until five in the afternoon."
)
BOATS = "Twenty-six boats are registered at the port, most of them under fifteen metres long."


@pytest.mark.parametrize(
    ("draft", "sentence", "follows"),
    [
        ("", GATE, True),  # nothing written yet
        ("The access code for the night gate is 4417.", GATE, True),
        ("The new code", GATE, True),
        ("The access code for the night gate is 44", GATE, True),  # may still become 4417
        ("The access code for the night gate is 4471 ", GATE, False),  # a value it lacks
        ("Boats", GATE, True),  # no whitespace yet: nothing settled
        ("Boats and ", GATE, False),
        # Margins of the benchmark's queries, beside the sentences closest to them.
        ("The harbour office is open on ", OFFICE, True),
        ("The harbour office is open on February ", OFFICE, False),  # a name it lacks
        ("Twenty-six boats are registered at the", BOATS, True),
        ("The annual report of the Port of Keldmouth includes", BOATS, False),
    ],
)
def test_a_draft_may_still_copy_its_expected_sentence(
    draft: str, sentence: str, follows: bool
) -> None:
    """The forecast that picks the early answer worth computing: a margin still being
    written is expected to copy the sentence while what it has settled could be grounded
    by that sentence alone (its values there, `min_coverage` of its words)."""
    assert may_still_copy(draft, sentence, min_coverage=0.8) is follows


@pytest.mark.parametrize("min_query_overlap", [0.0, 0.5, 0.8])
def test_no_start_of_a_margin_that_would_be_kept_is_called_hopeless(
    harbor, min_query_overlap: float
) -> None:
    """Soundness: a margin is cut short only where no continuation could be kept, so cutting
    never changes the notes. Margins: every sentence and every pair of sentences of the
    report copied (what the instruction asks for), and invented ones."""
    sentences = harbor.sentences
    copies = [
        harbor.document[sentences[i].start : sentences[j].end]
        for i in range(len(sentences))
        for j in (i, i + 1)
        if j < len(sentences)
    ]
    invented = [
        "The access code for the night gate is 4417, set in March.",
        "The access code for the night gate is 123456, it says.",
        "Tomas Reyez leads the pilot service.",
    ]
    kept_somewhere = 0
    for margin in copies + invented:
        verdict = harbor.ground(margin, min_coverage=0.8, max_sentences=2)
        kept = verdict.grounded and (
            query_overlap(NIGHT_GATE, verdict.evidence.text) >= min_query_overlap
        )
        cut = next(
            (n for n in range(len(margin) + 1) if hopeless(harbor, margin[:n], min_query_overlap)),
            None,
        )
        assert not (kept and cut is not None), (margin, margin[:cut])
        kept_somewhere += kept
        if "123456" in margin or "Reyez" in margin:
            assert cut is not None
    # The check has something to pass: kept copies exist at every threshold.
    assert kept_somewhere >= (2 if min_query_overlap else len(copies))


def test_evidence_is_the_supporting_sentence(harbor) -> None:
    verdict = harbor.ground("The night gate code is 4417.", min_coverage=0.8, max_sentences=2)
    assert verdict.evidence.text.startswith("The access code for the night gate keypad")
    assert "4417" in verdict.evidence.text
    # One sentence suffices here: the shortest supporting window wins.
    assert verdict.evidence.text.count(". ") == 0


def test_one_sentence_windows_cannot_join_two_sentences(harbor) -> None:
    margin = "Forty-two apprentices trained at the port, and a simulator for pilots was added."
    assert harbor.ground(margin, min_coverage=0.8, max_sentences=2).grounded
    assert not harbor.ground(margin, min_coverage=0.8, max_sentences=1).grounded


@pytest.mark.parametrize(
    "query",
    [
        "What is the access code for the night gate?",
        "Who replaced Margaret Oyelaran as head of the pilot service?",
        "How many passengers did the ferry to the islands carry?",
        "What is the capital of Peru?",
    ],
)
def test_best_query_overlap_is_the_best_any_evidence_window_has(harbor, query: str) -> None:
    """The bound skip_unmatched_segments relies on: no window of up to `max_sentences`
    sentences (what `ground` may return as evidence) shares more with the query."""
    sentences = harbor.sentences
    for max_sentences in (1, 2, 3):
        windows = [
            harbor.document[sentences[i].start : sentences[j].end]
            for i in range(len(sentences))
            for j in range(i, min(i + max_sentences, len(sentences)))
        ]
        best = max(query_overlap(query, window) for window in windows)
        assert harbor.best_query_overlap(query, max_sentences) == best


def test_claims_keep_numbers_and_names_and_drop_task_words() -> None:
    claim = Claim.parse("YES. The document states that Tomas Reyes paid 1,240 crowns.")
    assert claim.words == ("tomas", "reyes", "paid", "1240", "crowns")
    assert claim.numbers == {"1240"}
    assert claim.names == {"tomas", "reyes"}


def test_query_overlap_ranks_the_asked_for_fact_first() -> None:
    query = "What is the access code for the east pottery?"
    right = query_overlap(query, "The access code for the east pottery is 8515.")
    distractor = query_overlap(query, "The access code for the west ropewalk is 9523.")
    assert right == 1.0 and 0 < distractor < right


# -- the final step's notes budget ---------------------------------------------------------------


def test_final_suffix_within_admits_the_most_relevant_notes_first(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, PromptTemplates())
    notes = [
        MarginNote(i, f"Fact number {i} is a long sentence about boats.", i % 3) for i in range(6)
    ]
    full = builder.final_suffix("q?", notes)
    suffix, shown = builder.final_suffix_within("q?", notes, len(full))
    assert (suffix, shown) == (full, notes)
    plain = builder.final_suffix("q?", [])
    assert builder.final_suffix_within("q?", notes, len(plain)) == (plain, [])
    # Room for about two notes: the rank-2 ones (segments 2 and 5), shown in document order.
    two = builder.final_suffix("q?", [notes[2], notes[5]])
    suffix, shown = builder.final_suffix_within("q?", notes, len(two))
    assert [n.segment for n in shown] == [2, 5] and suffix == two


# -- the loop, on a scripted engine ------------------------------------------------------------

GATES = 24
# Long sentences: a snapped note is then longer than the margin it replaces.
DOC = "\n\n".join(
    f"Gate {i} stands by the harbour wall. The code for gate {i}, which opens the way between "
    f"the old stone quay, the fish market and the ferry berth, is {1000 + 7 * i}."
    for i in range(GATES)
)


@dataclass
class RecordingContext(FakeContext):
    finals: list[list[int]] = field(default_factory=list)

    def conclude(self, suffix_ids: list[int], params: GenerationParams):
        self.finals.append(suffix_ids)
        return super().conclude(suffix_ids, params)


@dataclass
class RecordingBackend(FakeBackend):
    window: int = 4096

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.window, 32, self.concurrent)

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> RecordingContext:
        self.contexts.append(RecordingContext(self))
        return self.contexts[-1]


def last_gate(backend: RecordingBackend, prefix: int) -> int:
    """The last gate whose code the first `prefix` tokens of the context tell."""
    read = backend.tokenizer.decode(backend.contexts[-1].ids[:prefix])
    return int(read.rsplit("The code for gate ", 1)[1].split(",")[0])


def last_gate_margin(backend: RecordingBackend, prefix: int, lie: bool) -> str:
    """A margin that restates the segment's last code (or a code nowhere in the document)."""
    gate = last_gate(backend, prefix)
    if lie:  # the invented code, then more words: grounding cuts it short after the code
        return f"Gate {gate} has code 99999, by the fish market."
    return f"Gate {gate} has code {1000 + 7 * gate}."


def scripted(tokenizer, lie_on: set[int]) -> RecordingBackend:
    calls: list[int] = []

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.ANSWER:
            return "Done."
        calls.append(prefix)
        return last_gate_margin(backend, prefix, len(calls) - 1 in lie_on)

    backend = RecordingBackend(tokenizer, script, concurrent=False)
    return backend


def wim_options(**kw) -> WiMOptions:
    return WiMOptions(
        relevance=RelevanceMode.NONE,
        segment_tokens=96,
        margin_max_tokens=12,
        answer_max_tokens=16,
        **kw,
    )


async def run(backend, query: str, options: WiMOptions) -> list:
    return [e async for e in run_wim(backend, backend.tokenizer, DOC, query, options)]


@pytest.mark.parametrize("mode", list(GroundingMode))
async def test_ungrounded_margins_never_reach_the_final_prompt(tokenizer, mode) -> None:
    backend = scripted(tokenizer, lie_on={1, 3})
    events = await run(backend, "What is the code for gate 5?", wim_options(grounding=mode))
    margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
    done = events[-1]
    assert done.type == "done" and len(margins) >= 6
    assert [m.segment for m in margins if not m.grounded] == [1, 3]
    final = tokenizer.decode(backend.contexts[0].finals[0])
    for m in margins:
        if m.grounded:
            assert DOC[m.evidence_start : m.evidence_end] == m.evidence
            assert m.evidence.startswith("The code for gate")
        else:
            assert m.evidence == "" and m.evidence_start is None
        assert m.kept is (m.grounded or mode is GroundingMode.OFF)
        # An ungrounded margin stops at its invented code, unless grounding is off.
        assert m.cut_short is (not m.grounded and mode is not GroundingMode.OFF)
        assert ("market" in m.text) is (not m.grounded and not m.cut_short)
    # The engine wrote the cut margins' tokens only up to the cut.
    cut = [end for end in backend.log if end[:2] == ("end", "margin") and end[3] < end[4]]
    assert len(cut) == (0 if mode is GroundingMode.OFF else 2)
    assert "99999" in final if mode is GroundingMode.OFF else "99999" not in final
    # Snapping shows the document's words; the other modes the margin's own.
    assert ("The code for gate" in final) is (mode is GroundingMode.SNAP)
    assert ("has code" in final) is (mode is not GroundingMode.SNAP)
    assert done.notes == [m.segment for m in margins if m.kept] and done.notes_dropped == []


async def test_a_cut_short_margin_is_not_sent_to_the_classifier(tokenizer) -> None:
    """Classifier relevance: a margin cut short is dropped whatever the second turn would
    say, so only the other margins are judged."""
    margins_written: list[int] = []

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.ANSWER:
            return "Done."
        if params.kind is RequestKind.CLASSIFIER:
            return "YES"
        margins_written.append(prefix)
        return last_gate_margin(backend, prefix, lie=len(margins_written) == 2)

    backend = RecordingBackend(tokenizer, script, concurrent=False)
    options = wim_options().model_copy(update={"relevance": RelevanceMode.CLASSIFIER})
    events = await run(backend, "What is the code for gate 5?", options)
    margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
    assert [m.segment for m in margins if m.cut_short] == [1]
    assert [m.segment for m in margins if not m.relevant] == [1]
    judged = [r for r in backend.requests if r.kind is RequestKind.CLASSIFIER]
    assert len(judged) == len(margins) - 1
    assert all("99999" not in tokenizer.decode(r.suffix) for r in judged)


async def test_a_first_token_margin_is_cut_short_after_its_yes(tokenizer) -> None:
    """First-token relevance: the cut-short check reads the margin without its YES, as
    grounding does ("Indeed" opens the margin: no name), and stops an invented code."""
    calls: list[int] = []

    def script(params: GenerationParams, prefix: int) -> str:
        if params.kind is RequestKind.ANSWER:
            return "Done."
        calls.append(prefix)
        gate = last_gate(backend, prefix)
        code = 99999 if len(calls) == 2 else 1000 + 7 * gate
        return (
            f"YES Indeed the code for gate {gate} is {code}, which opens the way between the "
            "old stone quay, the fish market and the ferry berth."
        )

    backend = RecordingBackend(tokenizer, script, concurrent=False)
    options = wim_options().model_copy(update={"relevance": RelevanceMode.FIRST_TOKEN})
    events = await run(backend, "What is the code for gate 5?", options)
    margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
    assert len(margins) >= 6 and all(m.relevant for m in margins)
    assert [m.segment for m in margins if m.cut_short] == [1]
    assert [m.segment for m in margins if not m.grounded] == [1]
    lie = f"Indeed the code for gate {last_gate(backend, calls[1])} is 99999, which"
    assert margins[1].text == lie  # without its YES, and stopped after the code


async def test_no_surviving_margin_gives_exactly_the_plain_prompt(tokenizer) -> None:
    backend = scripted(tokenizer, lie_on=set(range(100)))
    query = "What is the code for gate 5?"
    options = wim_options()
    events = await run(backend, query, options)
    assert not any(e.kept for e in events if e.type == "margin")
    context = backend.contexts[0]
    builder = PromptBuilder(tokenizer, options.prompts)
    plain = builder.plain_prompt(tokenizer.encode_user_text(DOC).ids, query)
    assert context.ids + context.finals[0] == plain
    assert events[-1].notes == [] and events[-1].notes_dropped == []


async def test_by_default_a_note_must_share_most_of_the_question(tokenizer) -> None:
    """note_min_query_overlap (default 0.8): grounded notes that share too little with the
    question (here only "ferry") are dropped and the final prompt is the plain one; with 0
    the same notes are kept."""
    query = "Where does the ferry wait at night?"
    strict = scripted(tokenizer, lie_on=set())
    events = await run(strict, query, wim_options(skip_unmatched_segments=False))
    margins = [e for e in events if e.type == "margin"]
    assert len(margins) >= 6 and all(m.grounded and not m.kept for m in margins)
    plain = PromptBuilder(tokenizer, wim_options().prompts).plain_prompt(
        tokenizer.encode_user_text(DOC).ids, query
    )
    assert strict.contexts[0].ids + strict.contexts[0].finals[0] == plain
    # By default no such margin is even written: every segment is skipped, same final prompt.
    skipping = scripted(tokenizer, lie_on=set())
    events = await run(skipping, query, wim_options())
    skipped = [e for e in events if e.type == "margin"]
    assert len(skipped) == len(margins) and all(m.skipped and not m.text for m in skipped)
    assert not [r for r in skipping.requests if r.kind is RequestKind.MARGIN]
    assert skipping.contexts[0].ids + skipping.contexts[0].finals[0] == plain
    lenient = scripted(tokenizer, lie_on=set())
    events = await run(lenient, query, wim_options(note_min_query_overlap=0.0))
    assert all(e.kept for e in events if e.type == "margin")
    assert events[-1].notes == [m.segment for m in margins]


async def test_only_segments_a_note_could_come_from_get_a_margin(tokenizer) -> None:
    """skip_unmatched_segments: a margin is written only where some evidence window shares
    `note_min_query_overlap` of the question, and the segments before it are pushed with it
    as one; the notes and the final prompt are those of the job that writes every margin."""
    query = "Which gate has the code 1035?"  # 1035 is gate 5's: only its segment matches
    outcomes = {}
    for skip in (True, False):
        backend = scripted(tokenizer, lie_on=set())
        events = await run(backend, query, wim_options(skip_unmatched_segments=skip))
        margins = sorted((e for e in events if e.type == "margin"), key=lambda e: e.segment)
        requests = [r for r in backend.requests if r.kind is RequestKind.MARGIN]
        outcomes[skip] = (
            [(m.segment, m.evidence) for m in margins if m.kept],
            backend.contexts[0].finals,
            events[-1].notes,
        )
        written = [m.segment for m in margins if not m.skipped]
        assert len(requests) == len(written)
        # Each push ends where a margin starts, or at the document's end.
        prefix = len(PromptBuilder(tokenizer, wim_options().prompts).context_prefix)
        ends = {e.segment: prefix + e.context_tokens for e in events if e.type == "segment"}
        pushes = [entry[1] for entry in backend.log if entry[0] == "extend-done"]
        assert pushes == sorted({ends[s] for s in written} | {ends[len(margins) - 1]})
        if skip:
            holding = [m.segment for m in margins if "1035" in DOC[m.char_start : m.char_end]]
            assert written == holding and len(holding) == 1
            assert all(not m.text and not m.kept for m in margins if m.skipped)
        else:
            assert len(written) == len(margins) >= 6
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][2]  # gate 5's code, kept as a note either way


async def test_notes_get_what_the_window_leaves_most_relevant_first(tokenizer) -> None:
    """Snapped evidence can be longer than the margin it replaces: the window caps the notes."""
    query = "What is the code for gate 5?"
    options = wim_options(grounding_max_sentences=2)
    roomy = scripted(tokenizer, lie_on=set())
    everything = await run(roomy, query, options)
    kept = [e.segment for e in everything if e.type == "margin" and e.kept]
    assert everything[-1].notes == sorted(kept) and len(kept) >= 6
    context_tokens = everything[-1].usage.context_tokens
    full_suffix = len(roomy.contexts[0].finals[0])
    # A window with room for the document, the answer and about half of the notes, which the
    # worst-case check (margins at margin_max_tokens) still admits.
    builder = PromptBuilder(tokenizer, options.prompts)
    per_margin = builder.margin_entry_overhead() + options.margin_max_tokens
    worst = len(builder.final_suffix(query, [])) + everything[-1].usage.segments * per_margin
    room = max(worst, full_suffix // 2)
    assert room < full_suffix - 40
    tight = scripted(tokenizer, lie_on=set())
    tight.window = context_tokens + options.answer_max_tokens + room
    events = await run(tight, query, options)
    done = events[-1]
    assert done.type == "done", done
    assert done.notes and done.notes_dropped
    assert sorted(done.notes + done.notes_dropped) == sorted(kept)
    final = tight.contexts[0].finals[0]
    assert context_tokens + len(final) + options.answer_max_tokens <= tight.window
    # The note that names gate 5 (its code is 1035) is the most relevant: it is kept.
    assert "1035" in tokenizer.decode(final)


# -- the real engine ----------------------------------------------------------------------------
