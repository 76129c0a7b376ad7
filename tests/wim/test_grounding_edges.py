"""The grounding check (`wim.grounding`) at its edges, on a small document: coverage exactly at
the threshold, the shortest fuzzy word, values that must match exactly, ties between windows,
denials, and claims that assert nothing. Verdicts on a real report are in test_grounding.py."""

from __future__ import annotations

import random
import re

import pytest

from wim_service.wim.grounding import (
    Claim,
    Grounding,
    SegmentText,
    _opens_sentence,
    query_overlap,
)
from wim_service.wim.segmentation import Segment

SENTENCES = [
    "The engine will work tonight.",
    "The gate code is 4417.",
    "The gates open at dawn.",
    "The gate code is 4417.",
    "Ships dock at Belmora harbour.",
    "The dock is never locked.",
    "The port employs 1,240 people.",
]
DOCUMENT = " ".join(SENTENCES)


@pytest.fixture
def segment() -> SegmentText:
    # Built for each test: a shared one would compute the sentences' vocabularies once, in
    # whichever test came first, and a change to them would be seen by that test alone.
    return SegmentText(DOCUMENT, Segment(0, 0, 0, 0, len(DOCUMENT)))


def start_of(n: int) -> int:
    """Character offset of sentence `n` (the first of equal sentences is found first)."""
    return len(" ".join(SENTENCES[:n])) + (1 if n else 0)


def test_coverage_exactly_at_the_threshold_grounds(segment: SegmentText) -> None:
    # "gate" is found, "zzzz" is not: half the claim's characters.
    verdict = segment.ground("gate zzzz", min_coverage=0.5, max_sentences=1)
    assert verdict.grounded and verdict.evidence is not None
    assert verdict.evidence.coverage == 0.5
    assert not segment.ground("gate zzzz", min_coverage=0.51, max_sentences=1).grounded


@pytest.mark.parametrize("max_sentences", [1, 3])
def test_of_equal_windows_the_first_and_shortest_is_the_evidence(
    segment: SegmentText, max_sentences: int
) -> None:
    # Sentences 1 and 3 are the same: the earlier one wins, alone.
    verdict = segment.ground("gate code 4417", min_coverage=0.8, max_sentences=max_sentences)
    assert verdict.evidence is not None
    assert verdict.evidence.char_start == start_of(1)
    assert verdict.evidence.text == SENTENCES[1]


def test_a_five_letter_word_matches_fuzzily(segment: SegmentText) -> None:
    verdict = segment.ground("engine works", min_coverage=1.0, max_sentences=1)
    assert verdict.grounded and verdict.evidence is not None
    assert verdict.evidence.text == SENTENCES[0]  # "works" ~ "work"


@pytest.mark.parametrize(
    ("margin", "coverage", "missing"),
    [
        ("code 44170", 4 / 9, ("44170",)),  # a number is never a near miss of another
        ("Ships dock at Belmor", 9 / 15, ("belmor",)),  # nor a name ("Belmora")
        ("engine purple", 6 / 12, ()),  # a word with no match is not found at all
        # Fuzzy is whole-word similarity: "engine" inside "engineering" is no match.
        ("tonight engineering", 7 / 18, ()),
        ("port employs 1240", 1.0, ()),  # "1,240" in the text: the same number
    ],
)
def test_exact_values_and_unmatched_words_are_not_found(
    segment: SegmentText, margin: str, coverage: float, missing: tuple[str, ...]
) -> None:
    verdict = segment.ground(margin, min_coverage=0.1, max_sentences=1)
    assert verdict.evidence is not None
    assert verdict.evidence.coverage == pytest.approx(coverage)
    assert verdict.missing == missing
    assert verdict.grounded is not missing


@pytest.mark.parametrize(
    "margin", ["dock never locked", "dock is not locked", "dock isn't locked", "dock isn’t locked"]
)
def test_a_denial_is_grounded_by_a_sentence_that_denies(segment: SegmentText, margin: str) -> None:
    verdict = segment.ground(margin, min_coverage=0.8, max_sentences=1)
    assert verdict.grounded and verdict.evidence is not None
    assert verdict.evidence.text == SENTENCES[5]


@pytest.mark.parametrize("margin", ["None.", "Not at all.", "It is not."])
def test_a_margin_asserting_nothing_has_no_evidence(segment: SegmentText, margin: str) -> None:
    verdict = segment.ground(margin, min_coverage=0.0, max_sentences=3)
    assert not verdict.grounded and verdict.evidence is None


def test_a_segment_without_sentences_grounds_nothing() -> None:
    blank = SegmentText("   ", Segment(0, 0, 0, 0, 3))
    assert blank.ground("gate code 4417", min_coverage=0.0, max_sentences=2) == Grounding(
        False, None
    )


def test_a_denial_is_one_exact_value_among_the_claims_words() -> None:
    claim = Claim.parse("The dock is never locked at night")
    denial = "\u00acnot"  # the marker a denial word becomes
    assert claim.words == ("dock", denial, "locked", "night")
    assert claim.numbers == {denial}


def test_names_are_capitalised_words_that_do_not_open_a_sentence() -> None:
    claim = Claim.parse("Ships reach Belmora. Kellan waits; Doran meets NASA crews")
    assert claim.names == {"belmora"}
    words = ("ships", "reach", "belmora", "kellan", "waits", "doran", "meets", "nasa", "crews")
    assert claim.words == words


def test_a_query_of_stop_words_overlaps_nothing() -> None:
    assert query_overlap("What is it?", "What is it? It is the gate.") == 0.0


# The regex `Claim.parse` searched on every word's prefix (quadratic in the text's words).
_OPENER_REGEX = re.compile(r"(?:^|[.!?:;]\s+|\n)\s*[\"'(\[]*$")


def test_sentence_openers_are_found_as_the_regex_found_them() -> None:
    alphabet = ["a", "B", " ", "\n", ".", ";", ",", '"', "(", "[", "'", "\t", "?"]
    rng = random.Random(7)
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        for start in range(len(text) + 1):
            expected = _OPENER_REGEX.search(text[:start]) is not None
            assert _opens_sentence(text, start) == expected, (text, start)


def test_a_claim_of_many_capitalised_words_parses_in_one_pass() -> None:
    # 200,000 capitalised words after one opener: each word's check reads only its own gap.
    claim = Claim.parse("Start " + "Harbour " * 200_000)
    assert claim.names == frozenset({"harbour"})
