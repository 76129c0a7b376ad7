"""The note policy: one keep rule, and every forecast of it moving with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wim_service.wim.grounding import SegmentText, query_overlap
from wim_service.wim.notes import NotePolicy
from wim_service.wim.options import GroundingMode, WiMOptions
from wim_service.wim.prompts import MarginNote
from wim_service.wim.segmentation import Segment

SENTENCE = "The access code for the night gate is 4417."
DOCUMENT = f"Gulls nest on the old pier all year. {SENTENCE} Boats leave early in summer."
QUERY = "What is the access code for the night gate of the ferry terminal?"
MARGIN = "The access code for the night gate is 4417."
DRAFT = "The night gate code is 4417 "  # a value settled: only SENTENCE holds it

SNAP = NotePolicy(
    grounding=GroundingMode.SNAP,
    min_query_overlap=0.8,
    min_coverage=0.8,
    max_sentences=2,
    skip_unmatched=True,
)


@pytest.fixture(scope="module")
def segment() -> SegmentText:
    return SegmentText(DOCUMENT, Segment(3, 0, 0, 0, len(DOCUMENT)))


@pytest.fixture(scope="module")
def overlap() -> float:
    share = query_overlap(QUERY, SENTENCE)
    assert 0 < share < 1  # the query asks more than the sentence says
    return share


def test_the_policy_reads_the_options() -> None:
    options = WiMOptions(
        grounding=GroundingMode.CHECK,
        note_min_query_overlap=0.4,
        grounding_min_coverage=0.6,
        grounding_max_sentences=3,
        skip_unmatched_segments=False,
    )
    assert NotePolicy.of(options) == NotePolicy(GroundingMode.CHECK, 0.4, 0.6, 3, False)


@pytest.mark.parametrize("above", [False, True])
def test_one_threshold_moves_the_verdict_and_every_forecast(
    segment: SegmentText, overlap: float, above: bool
) -> None:
    """The threshold at the sentence's own overlap keeps it (the rule is `>=`); just above,
    nothing is kept, and each forecast says so without restating the rule."""
    policy = replace(SNAP, min_query_overlap=overlap + (0.01 if above else 0.0))
    kept = not above
    verdict = policy.judge(segment, QUERY, MARGIN, relevant=True)
    assert verdict.note == SENTENCE and verdict.overlap == overlap
    assert verdict.kept is kept
    assert verdict.note_of(3) == (MarginNote(3, SENTENCE, rank=overlap) if kept else None)
    assert policy.none_can_be_kept(segment, QUERY) is not kept
    assert policy.cannot_keep(segment, DRAFT, QUERY) is not kept
    expected = policy.expected_note(segment, QUERY, "")
    assert expected == (MarginNote(3, SENTENCE, rank=overlap) if kept else None)


def test_the_verdict(segment: SegmentText, overlap: float) -> None:
    policy = replace(SNAP, min_query_overlap=0.1)
    assert not policy.judge(segment, QUERY, MARGIN, relevant=False).kept
    invented = "The access code for the night gate is 9999."
    refused = policy.judge(segment, QUERY, invented, relevant=True)
    assert not refused.kept and refused.evidence is None
    assert refused.note == invented  # nothing to snap to: the margin's own words
    # Checked, not snapped: the note is the margin's own words, grounded.
    check = replace(policy, grounding=GroundingMode.CHECK)
    worded = "The night gate access code is 4417."
    verdict = check.judge(segment, QUERY, worded, relevant=True)
    assert verdict.kept and verdict.note == worded
    assert verdict.evidence is not None and verdict.evidence.text == SENTENCE
    # Grounding off: an ungrounded margin is kept if it holds enough of the query.
    off = replace(policy, grounding=GroundingMode.OFF)
    assert off.judge(segment, QUERY, invented, relevant=True).kept
    assert not check.judge(segment, QUERY, invented, relevant=True).kept
    assert (
        not replace(off, min_query_overlap=0.99).judge(segment, QUERY, invented, relevant=True).kept
    )


def test_forecasts_only_where_the_rule_allows_them(segment: SegmentText) -> None:
    strict = replace(SNAP, min_query_overlap=0.99)
    assert strict.none_can_be_kept(segment, QUERY)
    assert strict.evidence_clears(0.99) and not strict.evidence_clears(0.98)
    # Skipping off, a threshold of 0, or notes in the margins' own words: no segment skipped.
    assert not replace(strict, skip_unmatched=False).none_can_be_kept(segment, QUERY)
    assert not replace(strict, min_query_overlap=0.0).none_can_be_kept(segment, "Pelicans?")
    for mode in (GroundingMode.CHECK, GroundingMode.OFF):
        loose = replace(strict, grounding=mode)
        assert loose.evidence_clears(0.0)
        assert not loose.none_can_be_kept(segment, QUERY)
        assert loose.expected_note(segment, QUERY, "") is None
    # Checked: a value the segment lacks still dooms the margin; grounding off, nothing does.
    check = replace(strict, grounding=GroundingMode.CHECK)
    assert check.cannot_keep(segment, "The code is 9999 ", QUERY)
    assert not check.cannot_keep(segment, DRAFT, QUERY)
    assert not replace(strict, grounding=GroundingMode.OFF).cannot_keep(
        segment, "The code is 9999 ", QUERY
    )


def test_an_expected_note_follows_the_draft(segment: SegmentText, overlap: float) -> None:
    policy = replace(SNAP, min_query_overlap=0.1)
    assert policy.expected_note(segment, QUERY, DRAFT) == MarginNote(3, SENTENCE, rank=overlap)
    assert policy.expected_note(segment, QUERY, "The code is 9999 ") is None
    assert policy.expected_note(segment, "Pelicans?", "") is None  # no sentence shares a word
    assert policy.may_still_give("", SENTENCE)
    assert policy.may_still_give(DRAFT, SENTENCE)
    assert not policy.may_still_give("Gulls nest on the old pier ", SENTENCE)
    assert replace(policy, min_coverage=0.0).may_still_give("Gulls nest on the old pier ", SENTENCE)
