"""Seeded, offline long-context tasks: needle, multi-hop, bAbI-style, CWE-style aggregation.

No data set can be downloaded here, so every document is generated: a grammar of bland filler
sentences (no numbers, no names, none of the words the questions use) with a few facts planted
at chosen depths, or a long numbered word list. Lengths are measured in the model's own tokens,
so a "4096-token" task fills the same share of every model's window.

Every task is a pure function of (seed, kind, length, index) and the tokenizer: the same
arguments give byte-identical documents on any machine.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from wim_service.wim.tokenizer import Tokenizer


class TaskKind(StrEnum):
    """The skill a task measures (the paper's single-hop, multi-hop and aggregation)."""

    NEEDLE = "needle"
    MULTI_HOP = "multi_hop"
    # People move between rooms, objects are picked up and dropped (BABILong's qa1-qa3).
    BABI = "babi"
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
    # The words a scorer counts in an answer: every word of an aggregation list, or every room
    # of a bAbI-style task (naming a second room is a wrong answer).
    vocabulary: frozenset[str] = frozenset()
    seed: int = 0


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


_ROOMS = ["kitchen", "garden", "hallway", "bathroom", "bedroom", "office", "cellar", "attic"]
_THINGS = ["apple", "football", "milk", "lantern", "umbrella", "violin"]
_MOVES = ["went to", "moved to", "travelled to", "journeyed to", "walked to", "ran to"]
_TAKES = ["picked up", "grabbed", "took", "got"]
_DROPS = ["dropped", "put down", "left", "discarded"]


@dataclass
class _World:
    """The state a bAbI-style story has reached: who is where, who holds what."""

    rng: random.Random
    people: list[str]
    things: list[str]
    room_of: dict[str, str] = field(default_factory=dict)  # person -> room
    holder: dict[str, str] = field(default_factory=dict)  # thing -> person
    lies_in: dict[str, str] = field(default_factory=dict)  # thing -> room, when not held
    story: list[str] = field(default_factory=list)
    # Indexes into `story` of the sentences that make each current fact true.
    support: dict[str, list[int]] = field(default_factory=dict)

    def _say(self, subject: str, verbs: list[str], rest: str) -> int:
        """Tell one event, in a wording the story has not used yet where one is left."""
        told = [f"{subject} {verb} the {rest}." for verb in verbs]
        fresh = [t for t in told if t not in self.story]
        self.story.append(self.rng.choice(fresh or told))
        return len(self.story) - 1

    def move(self, person: str, room: str | None = None) -> None:
        room = room or self.rng.choice([r for r in _ROOMS if r != self.room_of.get(person)])
        self.room_of[person] = room
        self.support[person] = [self._say(person, _MOVES, room)]
        for thing, who in self.holder.items():
            if who == person:  # a carried thing is where its carrier is
                self.support[thing] = [*self.support[thing][:1], self.support[person][0]]

    def take(self, person: str, thing: str) -> None:
        said = self._say(person, _TAKES, thing)
        self.holder[thing] = person
        self.lies_in.pop(thing, None)
        self.support[thing] = [said, self.support[person][0]]

    def drop(self, thing: str) -> None:
        person = self.holder.pop(thing)
        self.lies_in[thing] = self.room_of[person]
        said = self._say(person, _DROPS, thing)
        self.support[thing] = [*self.support[thing], said]

    def where(self, subject: str) -> str:
        if subject in self.room_of:
            return self.room_of[subject]
        return self.lies_in.get(subject) or self.room_of[self.holder[subject]]

    def step(self) -> None:
        """One random event that keeps the story consistent."""
        empty_handed = [p for p in self.people if p not in self.holder.values()]
        person = self.rng.choice(empty_handed) if empty_handed else None
        # A thing can be taken where it lies, or anywhere before it was first mentioned.
        room = self.room_of.get(person) if person is not None else None
        free = [
            t for t in self.things if t not in self.holder and self.lies_in.get(t, room) == room
        ]
        roll = self.rng.random()
        if person and free and roll < 0.3:
            self.take(person, self.rng.choice(free))
        elif self.holder and roll < 0.4:
            self.drop(self.rng.choice(sorted(self.holder)))
        else:
            self.move(self.rng.choice(self.people))


def _babi(rng: random.Random, sizer: _Sizer, target: int, task_id: str) -> Task:
    """A story of people moving and carrying things, interleaved with filler; "Where is X?".

    Half the questions ask for a person (the last of several moves counts: qa1), half for a
    thing, whose place follows from who took it and where they went next (qa2/qa3). Events
    are spread evenly over the document in story order.
    """
    world = _World(rng, _distinct(rng, 4, lambda r: _pseudo_word(r, 2).title()), [])
    world.things = rng.sample(_THINGS, 2)
    for person in world.people:
        world.move(person)
    events = 6 + target // 512
    while len(world.story) < events:
        world.step()
    if rng.random() < 0.5:
        subject = rng.choice(world.people)
        world.move(subject)  # the person's last move is never their first
        query = f"Where is {subject}?"
    else:
        subject = rng.choice(world.things)
        if subject not in world.holder:
            carrier = next(
                (p for p in world.people if p not in world.holder.values()), world.people[0]
            )
            for thing, who in list(world.holder.items()):
                if who == carrier:
                    world.drop(thing)
            if subject in world.lies_in and world.lies_in[subject] != world.room_of[carrier]:
                world.move(carrier, world.lies_in[subject])
            world.take(carrier, subject)
        world.move(world.holder[subject])  # the carrier moves on after taking it
        if rng.random() < 0.5:
            world.drop(subject)
        query = f"Where is the {subject}?"
    count = len(world.story)
    planted = [((i + rng.uniform(0.3, 0.7)) / count, s) for i, s in enumerate(world.story)]
    document = _prose(rng, sizer, target, planted)
    return Task(
        task_id,
        TaskKind.BABI,
        target,
        document,
        query,
        gold=(world.where(subject),),
        facts=tuple(world.story[i] for i in sorted(set(world.support[subject]))),
        vocabulary=frozenset(_ROOMS),
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
    TaskKind.BABI: _babi,
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
    """`samples` tasks of each kind at each length (tokens of the document alone).

    Task ids name the seed, so tasks of several seeds can be pooled and paired by id.
    """
    sizer = _Sizer(tokenizer)
    tasks = []
    for length in lengths:
        for kind in kinds:
            for index in range(samples):
                name = f"{kind.value}-{length}-{index}"
                # A string seed is hashed with SHA-512: stable across processes and machines.
                rng = random.Random(f"{seed}/{name}")
                task = _GENERATORS[kind](rng, sizer, length, f"{name}-s{seed}")
                tasks.append(dataclasses.replace(task, seed=seed))
    return tasks
