"""Seeded, offline long-context tasks: single needle, multi-hop, and CWE-style aggregation.

No data set can be downloaded here, so every document is generated: a grammar of bland filler
sentences (no numbers, no names, none of the words the questions use) with a few facts planted
at chosen depths, or a long numbered word list. Lengths are measured in the model's own tokens,
so a "4096-token" task fills the same share of every model's window.

Every task is a pure function of (seed, kind, length, index) and the tokenizer: the same
arguments give byte-identical documents on any machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from wim_service.wim.tokenizer import Tokenizer


class TaskKind(StrEnum):
    """The skill a task measures (the paper's single-hop, multi-hop and aggregation)."""

    NEEDLE = "needle"
    MULTI_HOP = "multi_hop"
    AGGREGATION = "aggregation"


@dataclass(frozen=True)
class Task:
    """One question over one generated document, with what a correct answer must contain."""

    task_id: str
    kind: TaskKind
    target_tokens: int
    document: str
    query: str
    # The expected value(s): one for QA tasks, the most common words for aggregation.
    gold: tuple[str, ...]
    # Planted sentences that together answer the query (QA tasks; empty for aggregation).
    facts: tuple[str, ...] = ()
    # Every distinct word of an aggregation list: answer words outside it are not counted.
    vocabulary: frozenset[str] = frozenset()


# -- generated vocabulary ---------------------------------------------------------------------

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "k"]


def _pseudo_word(rng: random.Random, syllables: int) -> str:
    """A pronounceable made-up word: the model cannot know it, so it cannot guess it."""
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )


def _distinct(rng: random.Random, n: int, make: Callable[[random.Random], str]) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(make(rng), None)
    return list(seen)


def _person(rng: random.Random) -> str:
    return f"{_pseudo_word(rng, 2).title()} {_pseudo_word(rng, 2).title()}"


def _town(rng: random.Random) -> str:
    return _pseudo_word(rng, 3).title()


_PLACES = [
    "bakery", "boathouse", "library", "tannery", "observatory", "sawmill", "pharmacy",
    "foundry", "greenhouse", "lighthouse", "brewery", "print shop", "weaving mill",
    "post office", "dairy", "ropewalk", "glassworks", "pottery", "chapel", "granary",
]  # fmt: skip
_PLACE_ADJECTIVES = ["north", "south", "east", "west", "upper", "lower", "old", "new"]


def _place(rng: random.Random) -> str:
    return f"{rng.choice(_PLACE_ADJECTIVES)} {rng.choice(_PLACES)}"


# -- filler ------------------------------------------------------------------------------------

_SUBJECTS = [
    "The grey heron", "A tired traveller", "The river", "An old fisherman", "The wind",
    "A small dog", "The morning fog", "A group of children", "The shepherd", "The orchard",
    "A passing cart", "The teacher", "The farmer's daughter", "A flock of geese", "The rain",
    "The village choir", "A wandering painter", "The miller", "The evening bell", "A young fox",
]  # fmt: skip
_VERBS = [
    "drifted past", "waited beside", "looked across", "wandered toward", "rested near",
    "circled around", "sang softly about", "paused under", "followed", "hurried along",
    "settled over", "leaned against", "walked slowly past", "watched", "returned to",
]  # fmt: skip
_OBJECTS = [
    "the quiet meadow", "the stone bridge", "the muddy lane", "the willow trees",
    "the empty market", "the narrow canal", "the hillside", "the broken fence", "the hedgerow",
    "the wide valley", "the pebble beach", "the chestnut grove", "the harbour wall",
    "the sleepy square", "the reed beds", "the wooden pier", "the open field",
]  # fmt: skip
_TAILS = [
    "", "", "", " before noon", " in the soft light", " as the clouds gathered",
    " while the kettle boiled", " without a sound", " for a long while", " at dusk",
    " once again", " as it did every season", " under a pale sky", " after the storm",
]  # fmt: skip


def _filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}" + (
        f"{rng.choice(_TAILS)}."
    )


class _Sizer:
    """Token counts of pieces of text, for filling a document to a token budget."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode_user_text(text).ids)


def _prose(rng: random.Random, sizer: _Sizer, target: int, planted: list[tuple[float, str]]) -> str:
    """Filler prose of at most `target` tokens with each (depth, sentence) planted in it.

    Depths are fractions of the document (0 = start). Paragraphs of 4-8 sentences give the
    segmenter blank lines to cut at, as a real report would.
    """
    budget = target - sum(sizer.count(" " + s) for _, s in planted)
    filler: list[str] = []
    used = 0
    while True:
        sentence = _filler_sentence(rng)
        cost = sizer.count(" " + sentence)
        if used + cost > budget:
            break
        filler.append(sentence)
        used += cost
    breaks = _paragraph_breaks(rng, len(filler) + len(planted))

    def assemble(fill: list[str]) -> str:
        sentences = list(fill)
        for depth, sentence in sorted(planted, key=lambda p: p[0]):
            sentences.insert(round(depth * len(fill)), sentence)
        paragraphs, start = [], 0
        for end in [b for b in breaks if b < len(sentences)] + [len(sentences)]:
            if end > start:
                paragraphs.append(" ".join(sentences[start:end]))
            start = end
        return "\n\n".join(paragraphs)

    text = assemble(filler)
    # Per-sentence counts only estimate the joined text's tokens: trim until it truly fits.
    while sizer.count(text) > target and filler:
        filler.pop()
        text = assemble(filler)
    return text


def _paragraph_breaks(rng: random.Random, sentences: int) -> list[int]:
    breaks, at = [], 0
    while at < sentences:
        at += rng.randint(4, 8)
        breaks.append(at)
    return breaks


# -- the three kinds -----------------------------------------------------------------------------


def _needle(rng: random.Random, sizer: _Sizer, target: int, task_id: str) -> Task:
    """One access code among distractor codes for other places, at a random depth."""
    places = _distinct(rng, 3, _place)
    codes = [str(c) for c in rng.sample(range(1000, 10000), len(places))]
    facts = [f"The access code for the {p} is {c}." for p, c in zip(places, codes, strict=True)]
    depths = [rng.uniform(0.05, 0.95) for _ in facts]
    document = _prose(rng, sizer, target, list(zip(depths, facts, strict=True)))
    return Task(
        task_id,
        TaskKind.NEEDLE,
        target,
        document,
        f"What is the access code for the {places[0]}?",
        gold=(codes[0],),
        facts=(facts[0],),
    )


def _multi_hop(rng: random.Random, sizer: _Sizer, target: int, task_id: str) -> Task:
    """A chain of two or three linked facts planted far apart, with a distractor chain.

    Two hops: X works at P; P is in town T; "In which town does X work?". Three hops add a
    spouse in front: "In which town does the spouse of Y work?". The query names neither P nor
    T, so the bridge facts share few words with it (hard for keyword retrieval, as in HotpotQA).
    """
    hops = rng.choice([2, 3])
    people = _distinct(rng, 4, _person)
    places = _distinct(rng, 2, _place)
    towns = _distinct(rng, 2, _town)
    chains = []
    for k in range(2):
        worker, spouse = people[2 * k], people[2 * k + 1]
        chain = [f"{worker} works at the {places[k]}.", f"The {places[k]} is in {towns[k]}."]
        if hops == 3:
            chain.insert(0, f"{spouse} is married to {worker}.")
        rng.shuffle(chain)  # the bridge fact may come before or after the answer fact
        chains.append(chain)
    # The real chain's facts spread evenly over the document; the distractor's in between.
    spread = [(i + 0.5) / hops for i in range(hops)]
    planted = [(d, s) for d, s in zip(spread, chains[0], strict=True)]
    planted += [
        (d + 0.5 / hops * rng.uniform(0.3, 0.7), s) for d, s in zip(spread, chains[1], strict=True)
    ]
    planted = [(min(d, 0.97), s) for d, s in planted]
    document = _prose(rng, sizer, target, planted)
    subject = f"the spouse of {people[1]}" if hops == 3 else people[0]
    return Task(
        task_id,
        TaskKind.MULTI_HOP,
        target,
        document,
        f"In which town does {subject} work?",
        gold=(towns[0],),
        facts=tuple(chains[0]),
    )


COMMON_WORDS = 5


def _aggregation(rng: random.Random, sizer: _Sizer, target: int, task_id: str) -> Task:
    """CWE (RULER's common words extraction): the most frequent words of a numbered list.

    Each common word appears several times more often than any other word, at random places.
    """
    sample = [f"{n}. {_pseudo_word(rng, 2)}" for n in range(100, 150)]
    entry_tokens = sizer.count("\n".join(sample)) / len(sample)
    entries = max(int(target / entry_tokens), 4 * COMMON_WORDS)
    common_freq = max(4, entries // (4 * COMMON_WORDS))
    rare_freq = max(1, common_freq // 4)
    # Round up: the list is then trimmed to the exact budget below.
    rare_count = math.ceil(max(entries * 1.1 - COMMON_WORDS * common_freq, 0) / rare_freq)
    words = _distinct(rng, COMMON_WORDS + rare_count, lambda r: _pseudo_word(r, 2))
    common, rare = words[:COMMON_WORDS], words[COMMON_WORDS:]
    items = common * common_freq + rare * rare_freq
    rng.shuffle(items)

    def render(items: list[str]) -> str:
        lines = [f"{n}. {w}" for n, w in enumerate(items, 1)]
        # A blank line every 20 entries: cut points for the segmenter.
        return "\n\n".join("\n".join(lines[i : i + 20]) for i in range(0, len(lines), 20))

    document = render(items)
    while (excess := sizer.count(document) - target) > 0:
        # Drop rare entries from the end (the common words keep their lead), about as many as
        # the excess tokens hold.
        for _ in range(max(1, int(excess / entry_tokens))):
            items.pop(max(i for i, w in enumerate(items) if w not in common))
        document = render(items)
    return Task(
        task_id,
        TaskKind.AGGREGATION,
        target,
        document,
        f"What are the {COMMON_WORDS} most common words in the list? Answer with the "
        f"{COMMON_WORDS} words only, separated by commas.",
        gold=tuple(common),
        vocabulary=frozenset(items),
    )


_GENERATORS = {
    TaskKind.NEEDLE: _needle,
    TaskKind.MULTI_HOP: _multi_hop,
    TaskKind.AGGREGATION: _aggregation,
}


def generate_tasks(
    tokenizer: Tokenizer,
    *,
    kinds: list[TaskKind],
    lengths: list[int],
    samples: int,
    seed: int,
) -> list[Task]:
    """`samples` tasks of each kind at each length (tokens of the document alone)."""
    sizer = _Sizer(tokenizer)
    tasks = []
    for length in lengths:
        for kind in kinds:
            for index in range(samples):
                task_id = f"{kind.value}-{length}-{index}"
                # A string seed is hashed with SHA-512: stable across processes and machines.
                rng = random.Random(f"{seed}/{task_id}")
                tasks.append(_GENERATORS[kind](rng, sizer, length, task_id))
    return tasks
