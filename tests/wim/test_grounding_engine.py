"""Grounded margins on the real vLLM engine with the real default model (fp32): the README's
example, "do no harm" token for token, and margins cut short where they name what their
segment lacks."""

from __future__ import annotations

import time

import pytest

from tests.engine.test_vllm_engine import spans_since, wait_for_baseline
from tests.fakes.engine import RecordingEngine
from wim_service.eval.tasks import TaskKind, generate_tasks
from wim_service.wim.backend import RequestKind
from wim_service.wim.grounding import SegmentText, query_overlap
from wim_service.wim.options import GroundingMode, RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.segmentation import Segment

README_QUERY = "What is the access code for the night gate?"


@pytest.mark.engine
async def test_readme_example_answers_from_the_document(engine, report) -> None:
    """The README's first example with the default configuration (segment_tokens 192): the
    margins that invent a code are dropped and the answer is the document's 4417. Without
    skip_unmatched_segments every segment gets a margin, and the notes and the answer are
    the same, token for token."""
    outcomes, requests = {}, {}
    for skip in (True, False):
        options = WiMOptions(segment_tokens=192, skip_unmatched_segments=skip)
        started = time.monotonic()
        events = [e async for e in run_wim(engine, engine.tokenizer, report, README_QUERY, options)]
        written = [s for s in spans_since(engine, started) if s.kind == RequestKind.MARGIN.value]
        done = events[-1]
        assert done.type == "done", done
        assert "4417" in done.answer
        margins = [e for e in events if e.type == "margin"]
        kept = [m for m in margins if m.kept]
        assert kept and all(m.grounded and m.evidence in report for m in kept)
        assert any("4417" in m.evidence for m in kept)
        assert done.notes == sorted(m.segment for m in kept) and done.notes_dropped == []
        assert len(written) == sum(not m.skipped for m in margins)
        assert len(margins) == done.usage.segments
        requests[skip] = len(written)
        outcomes[skip] = (done.answer, done.usage.answer_tokens, [m.evidence for m in kept])
    assert outcomes[True] == outcomes[False]
    assert 0 < requests[True] < requests[False] == done.usage.segments


@pytest.mark.engine
async def test_no_surviving_margin_answers_token_for_token_as_plain(engine, report) -> None:
    """Do no harm: when no margin survives, WiM's final prompt is the plain long-context
    prompt and its answer is plain's, token for token (fp32, greedy)."""
    # First-token relevance with one-token margins: every margin is its YES/NO alone, so empty.
    options = WiMOptions(
        relevance=RelevanceMode.FIRST_TOKEN,
        segment_tokens=192,
        margin_max_tokens=1,
        answer_max_tokens=40,
    )
    recording = RecordingEngine(engine)
    events = [e async for e in run_wim(recording, engine.tokenizer, report, README_QUERY, options)]
    done = events[-1]
    assert done.type == "done", done
    assert not any(e.kept for e in events if e.type == "margin") and done.notes == []
    builder = PromptBuilder(engine.tokenizer, options.prompts)
    document_ids = engine.tokenizer.encode_user_text(report).ids
    plain_ids = builder.plain_prompt(document_ids, README_QUERY)
    assert builder.context_prefix + document_ids + recording.finals[-1] == plain_ids
    plain = await engine.complete(plain_ids, max_tokens=options.answer_max_tokens)
    assert done.answer == plain.text.strip()
    assert done.usage.answer_tokens == len(plain.token_ids)


@pytest.mark.engine
async def test_a_margin_that_names_what_its_segment_lacks_is_cut_short(engine, report) -> None:
    """Margins that invent a number or name stop there; written to the end (grounding off,
    nothing cut) each of them is the same text continued, and still ungrounded."""
    query = "How many passengers did the ferry to the islands carry?"

    async def margins(grounding: GroundingMode) -> tuple[dict[int, object], object]:
        # Every segment written: no sentence of the report shares 0.8 of this query's words;
        # without the query filter, only values the segment lacks cut a margin short.
        options = WiMOptions(
            segment_tokens=192,
            grounding=grounding,
            skip_unmatched_segments=False,
            note_min_query_overlap=0.0,
        )
        events = [e async for e in run_wim(engine, engine.tokenizer, report, query, options)]
        assert events[-1].type == "done", events[-1]
        return {e.segment: e for e in events if e.type == "margin"}, events[-1]

    baseline = await wait_for_baseline(engine, (await engine.kv_stats()).free_blocks)
    cut, cut_done = await margins(GroundingMode.SNAP)
    # The cut margins' requests were aborted, not left running: every block is free again.
    assert engine.engine.get_num_unfinished_requests() == 0
    stats = await wait_for_baseline(engine, baseline.free_blocks)
    assert stats.free_blocks == baseline.free_blocks and stats.parked_sessions == 0
    assert engine.load().reserved_blocks == 0
    whole, whole_done = await margins(GroundingMode.OFF)
    short = [s for s, m in cut.items() if m.cut_short]
    assert short and not any(m.cut_short for m in whole.values())
    for segment, margin in cut.items():
        assert whole[segment].grounded is margin.grounded
        if segment in short:
            assert not margin.grounded and not margin.kept
            assert whole[segment].text.startswith(margin.text)
            assert len(whole[segment].text) > len(margin.text)
        else:
            assert whole[segment].text == margin.text
    assert cut_done.usage.margin_tokens < whole_done.usage.margin_tokens


@pytest.mark.engine
async def test_a_margin_that_names_what_only_far_sentences_hold_is_cut_short(
    engine, report
) -> None:
    """With the query filter on (the default), a margin also stops at a number or name that
    only sentences far from the question hold. Each cut margin is the start of the margin the
    model writes in full (grounding off, nothing cut), and snapping and the filter keep from
    the full margins exactly the notes the job kept: cutting changed no note."""
    query = "How many boats are registered at the port?"
    options = WiMOptions(segment_tokens=192, skip_unmatched_segments=False)  # every margin
    runs = {}
    for grounding in (GroundingMode.SNAP, GroundingMode.OFF):
        events = [
            e
            async for e in run_wim(
                engine,
                engine.tokenizer,
                report,
                query,
                options.model_copy(update={"grounding": grounding}),
            )
        ]
        assert events[-1].type == "done", events[-1]
        runs[grounding] = ({e.segment: e for e in events if e.type == "margin"}, events[-1])
    (cut, cut_done), (whole, whole_done) = runs[GroundingMode.SNAP], runs[GroundingMode.OFF]
    far = []
    for segment, margin in cut.items():
        full = whole[segment].text
        segment_text = SegmentText(
            report, Segment(segment, 0, 0, margin.char_start, margin.char_end)
        )
        verdict = segment_text.ground(full, min_coverage=0.8, max_sentences=2)
        kept_in_full = verdict.grounded and query_overlap(query, verdict.evidence.text) >= 0.8
        assert margin.kept is kept_in_full, (segment, margin.text, full)
        if margin.kept:
            assert margin.evidence == verdict.evidence.text
        if margin.cut_short:
            assert full.startswith(margin.text) and len(full) > len(margin.text)
            written = margin.text + " "
            assert segment_text.cannot_keep(
                written, query, max_sentences=2, clears=lambda share: share >= 0.8
            )
            # Every value it had named is in some window: only the query filter ruled it out.
            if not segment_text.cannot_keep(
                written, query, max_sentences=2, clears=lambda share: True
            ):
                far.append(segment)
        else:
            assert full == margin.text
    assert far, {s: m.text for s, m in cut.items()}
    assert cut_done.notes == sorted(s for s, m in cut.items() if m.kept)
    assert cut_done.usage.margin_tokens < whole_done.usage.margin_tokens


@pytest.mark.engine
async def test_a_margin_ends_after_its_first_sentence_on_the_real_engine(engine) -> None:
    """margin_max_sentences (default 1) on a bAbI-style task, whose margins ramble on from
    one filler sentence to the next: each margin is the first sentence of the margin written
    without the limit, and the notes and the answer are the same, token for token."""
    (task,) = generate_tasks(
        engine.tokenizer, kinds=[TaskKind.BABI], lengths=[1024], samples=1, seed=0
    )
    runs = {}
    for limit in (1, None):
        options = WiMOptions(margin_max_sentences=limit)
        events = [
            e async for e in run_wim(engine, engine.tokenizer, task.document, task.query, options)
        ]
        assert events[-1].type == "done", events[-1]
        runs[limit] = ({e.segment: e.text for e in events if e.type == "margin"}, events[-1])
    (short, short_done), (full, full_done) = runs[1], runs[None]
    assert short.keys() == full.keys()
    longer = [s for s in short if short[s] != full[s]]
    assert longer, full  # some margin went on past its first sentence
    for segment in longer:
        assert full[segment].startswith(short[segment]) and short[segment].endswith(".")
    assert short_done.answer == full_done.answer and short_done.notes == full_done.notes
    assert short_done.usage.answer_tokens == full_done.usage.answer_tokens
    assert short_done.usage.margin_tokens < full_done.usage.margin_tokens
