"""Grounding: a margin may reach the final prompt only if its own segment says what it says.

Small models write margins that state what the segment does not say (a distractor's value
attributed to the asked-for place, a code that appears nowhere), and the answer copies them.
A margin is therefore checked against the sentences of its own segment:

* its *claim words* (content words, minus stop words and reading-task words such as
  "document" or "states") are looked up in a window of one or a few consecutive sentences,
  fuzzily (rapidfuzz, so "works" matches "work"), and must cover at least `min_coverage` of the
  claim's characters;
* every number and every name (a capitalised word that does not open a sentence) must occur in
  that window exactly: a near miss is a different code or person.

The best window is the margin's *evidence*: the document's own words with their character
span. With snapping on, the final step reads the evidence instead of the margin.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from rapidfuzz import fuzz, process

from wim_service.wim.segmentation import Segment, sentence_ends

# Numbers keep their digits only ("1,240" and "1240" are one value); words are lower-cased.
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['’][^\W\d_]+)?")
# Whitespace and what follows it, up to the end: the word a stream may still be writing.
_LAST_WORD = re.compile(r"\s\S*\Z")
_OPENING_MARKS = "\"'(["
_SENTENCE_ENDS = ".!?:;"
# A fuzzy word match: "works" ~ "work", but not "east" ~ "west" (75) or "Belmor" ~ "Belmora".
_WORD_CUTOFF = 85.0
_MIN_FUZZY_LENGTH = 5

STOP_WORDS = frozenset(
    """
    a an the and or but of to in on at for from by with as into onto about over under than then
    is are was were be been being am has have had do does did done will would shall should can
    could may might must this that these those it its it's there here their they them he him his
    she her hers we us our you your i me my which who whom whose what where when why how so if
    not no yes also only just very any all some each every such same other both either neither
    answer answers question questions document documents segment segments text passage note notes
    state states stated statement say says said mention mentions mentioned write writes written
    according information provided provide provides given above below following fact facts
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
# A margin that denies ("the document does not say...") is grounded only by a sentence that
# denies too: each denial word counts as this one exact value.
_DENIAL = "\u00acnot"
_DENIAL_WORDS = frozenset({"not", "no", "none", "nothing", "never", "cannot", "unknown"})


def _is_denial(word: str) -> bool:
    return word in _DENIAL_WORDS or word.endswith(("n't", "n’t"))


def _normalize(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _is_number(token: str) -> bool:
    return token[0].isdigit()


def _opens_sentence(text: str, start: int) -> bool:
    """Whether the word at `start` opens a sentence: only opening marks, then white space,
    stand between it and the text's start, a line break, or a sentence end. A scan back over
    those marks and that space (linear over a whole text: each gap is read once), where a
    regex searched on every word's prefix was quadratic in the text."""
    at = start
    while at > 0 and text[at - 1] in _OPENING_MARKS:
        at -= 1
    space_end = at
    while at > 0 and text[at - 1].isspace():
        at -= 1
    space = text[at:space_end]
    return at == 0 or "\n" in space or (bool(space) and text[at - 1] in _SENTENCE_ENDS)


def _number_value(token: str) -> str:
    """Digits of a number with thousands separators removed ("1,240" -> "1240")."""
    return re.sub(r"(?<=\d)[,](?=\d{3}\b)", "", token)


@dataclass(frozen=True)
class Claim:
    """What a margin asserts, as the grounding check sees it."""

    words: tuple[str, ...]  # lower-cased content words (numbers and names included)
    numbers: frozenset[str]  # and the denial marker: values that must match exactly
    names: frozenset[str]  # lower-cased

    @property
    def exact_values(self) -> frozenset[str]:
        """The numbers and names (and the denial marker): found exactly, or not grounded."""
        return self.numbers | self.names

    @classmethod
    def parse(cls, text: str) -> Claim:
        text = _normalize(text)
        words: list[str] = []
        numbers: set[str] = set()
        names: set[str] = set()
        for match in _TOKEN.finditer(text):
            token = match.group()
            if _is_number(token):
                value = _number_value(token)
                numbers.add(value)
                words.append(value)
                continue
            word = token.lower()
            if _is_denial(word):
                numbers.add(_DENIAL)
                words.append(_DENIAL)
                continue
            if word in STOP_WORDS:
                continue
            words.append(word)
            if (
                token[0].isupper()
                and not token.isupper()
                and not _opens_sentence(text, match.start())
            ):
                names.add(word)
        return cls(tuple(words), frozenset(numbers), frozenset(names))


def vocabulary(text: str) -> frozenset[str]:
    """Every word and number of `text`, normalized as claims are."""
    words = {
        _number_value(t) if _is_number(t) else t.lower() for t in _TOKEN.findall(_normalize(text))
    }
    if any(_is_denial(w) for w in words):
        words.add(_DENIAL)
    return frozenset(words)


@dataclass(frozen=True)
class Evidence:
    """Consecutive sentences of the document that support a margin."""

    text: str
    char_start: int  # offsets in the whole document
    char_end: int
    coverage: float  # share of the claim's characters found in it


@dataclass(frozen=True)
class Grounding:
    """The verdict on one margin; `evidence` is the best window found (None if no claim)."""

    grounded: bool
    evidence: Evidence | None
    missing: tuple[str, ...] = ()  # numbers and names of the claim that the evidence lacks


def _covered(claim: Claim, vocabulary: frozenset[str]) -> tuple[float, tuple[str, ...]]:
    """(share of claim characters found in `vocabulary`, exact values missing from it)."""
    found = total = 0
    choices = list(vocabulary)
    for word in claim.words:
        total += len(word)
        if word in vocabulary or (
            len(word) >= _MIN_FUZZY_LENGTH
            and word not in claim.numbers
            and word not in claim.names
            and process.extractOne(word, choices, scorer=fuzz.ratio, score_cutoff=_WORD_CUTOFF)
        ):
            found += len(word)
    missing = tuple(sorted(claim.exact_values - vocabulary))
    return (found / total if total else 0.0), missing


@dataclass(frozen=True)
class _Sentence:
    start: int  # offsets in the document
    end: int
    vocabulary: frozenset[str]


@dataclass(frozen=True)
class _Window:
    """Consecutive sentences of the largest size evidence may have: every window `ground` can
    return lies inside one of them, with a vocabulary (and so a query overlap) no larger."""

    vocabulary: frozenset[str]  # as `ground` reads it: its sentences' vocabularies joined
    query_overlap: float  # as the query filter reads its text


class SegmentText:
    """A segment's sentences (punkt, as the segmenter cuts), with their vocabularies."""

    def __init__(self, document: str, segment: Segment) -> None:
        self.document = document
        self.segment = segment
        # The last (query, max_sentences) asked and its windows: a job asks when it pushes the
        # segment and again while its margin is written; one entry keeps a long-lived session's
        # memory flat.
        self._windows: tuple[tuple[str, int], list[_Window]] | None = None

    @cached_property
    def sentences(self) -> list[_Sentence]:
        start = self.segment.char_start
        text = self.document[start : self.segment.char_end]
        bounds = [0, *sentence_ends(text), len(text)]
        sentences = []
        for a, b in itertools.pairwise(bounds):
            piece = text[a:b]
            stripped = piece.strip()
            if not stripped:
                continue
            lead = len(piece) - len(piece.lstrip())
            s = start + a + lead
            sentences.append(_Sentence(s, s + len(stripped), vocabulary(stripped)))
        return sentences

    def largest_windows(self, query: str, max_sentences: int) -> list[_Window]:
        """The windows of exactly `max_sentences` sentences (the whole segment, if shorter),
        scored against `query`. A window's vocabulary holds every smaller window's inside it,
        and a larger vocabulary only finds more, so these bound every evidence `ground` may
        return: what none of them holds, no evidence does."""
        key = (query, max_sentences)
        if self._windows is None or self._windows[0] != key:
            size = min(max_sentences, len(self.sentences))
            windows = []
            for i in range(len(self.sentences) - size + 1 if size else 0):
                first, last = self.sentences[i], self.sentences[i + size - 1]
                windows.append(
                    _Window(
                        frozenset().union(*(s.vocabulary for s in self.sentences[i : i + size])),
                        query_overlap(query, self.document[first.start : last.end]),
                    )
                )
            self._windows = (key, windows)
        return self._windows[1]

    def best_query_overlap(self, query: str, max_sentences: int) -> float:
        """The highest `query_overlap` that any evidence `ground` can return here may have."""
        return max(
            (w.query_overlap for w in self.largest_windows(query, max_sentences)), default=0.0
        )

    def cannot_keep(
        self, partial: str, query: str, *, max_sentences: int, clears: Callable[[float], bool]
    ) -> bool:
        """Whether `partial`, the start of a margin still being written, already holds a number
        or name (or a denial) that no window of this segment holds together with a share of
        the query that `clears` the keep rule's filter (`notes.NotePolicy`, the one place that
        states it). Evidence must hold every such value, and with snapping the note is the
        evidence, so then `ground` or the query filter refuses every continuation of it, and
        the margin need not be written to its end (pass a `clears` that accepts any share when
        the filter reads the margin's own words).

        Only what it has settled (`_settled`) counts as written. A margin that has written no
        such value yet is never hopeless: coverage alone may still ground it.
        """
        values = Claim.parse(_settled(partial)).exact_values
        return bool(values) and not any(
            values <= window.vocabulary and clears(window.query_overlap)
            for window in self.largest_windows(query, max_sentences)
        )

    def closest_sentence(self, query: str) -> tuple[str, float]:
        """The sentence sharing most with the query (the first of equals) and its
        `query_overlap`; ("", 0.0) if none shares anything. A margin that copies it, as the
        margin instruction asks, is snapped to it."""
        best = ("", 0.0)
        for sentence in self.sentences:
            text = self.document[sentence.start : sentence.end]
            if (overlap := query_overlap(query, text)) > best[1]:
                best = (text, overlap)
        return best

    def ground(self, margin: str, *, min_coverage: float, max_sentences: int) -> Grounding:
        """Check `margin` against every window of up to `max_sentences` consecutive sentences."""
        claim = Claim.parse(margin)
        if not set(claim.words) - {_DENIAL}:  # nothing asserted ("NO", "None.")
            return Grounding(False, None)
        best_key: tuple[bool, float, int] | None = None
        best = Grounding(False, None)
        for i in range(len(self.sentences)):
            vocabulary: frozenset[str] = frozenset()
            for j in range(i, min(i + max_sentences, len(self.sentences))):
                vocabulary |= self.sentences[j].vocabulary
                coverage, missing = _covered(claim, vocabulary)
                # Best: every exact value present, then the highest coverage, then the shortest.
                key = (not missing, coverage, i - j)
                if best_key is None or key > best_key:
                    best_key = key
                    start, end = self.sentences[i].start, self.sentences[j].end
                    evidence = Evidence(self.document[start:end], start, end, coverage)
                    grounded = coverage >= min_coverage and not missing
                    best = Grounding(grounded, evidence, missing)
        return best


def _settled(partial: str) -> str:
    """What a text still being written has settled: all before its last whitespace (a word or
    number cannot reach across whitespace, while "212," may still become "212,000"); nothing
    before its first whitespace."""
    written = _LAST_WORD.sub("", partial)
    return written if len(written) < len(partial) else ""


def may_still_copy(partial: str, sentence: str, *, min_coverage: float) -> bool:
    """Whether `partial`, the start of a margin still being written, may still be grounded by
    `sentence`: what it has settled (`_settled`) names no number or name the sentence lacks,
    and the sentence holds `min_coverage` of its claim so far. A forecast, not a verdict
    (later words may raise the coverage again): it only decides which early answer is worth
    computing."""
    claim = Claim.parse(_settled(partial))
    if not claim.words:
        return True
    coverage, missing = _covered(claim, vocabulary(sentence))
    return not missing and coverage >= min_coverage


def query_overlap(query: str, text: str) -> float:
    """Share of the query's content characters found in `text` (fuzzy words, exact values):
    a lexical relevance score for ranking and filtering grounded notes."""
    coverage, _ = _covered(Claim.parse(query), vocabulary(text))
    return coverage
