"""Generated evaluation tasks: deterministic, sized in model tokens, facts really planted."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from wim_service.eval.tasks import COMMON_WORDS, Task, TaskKind, generate_tasks

LENGTHS = [512, 2048]


@pytest.fixture(scope="module")
def tasks(tokenizer) -> list[Task]:
    return generate_tasks(tokenizer, kinds=list(TaskKind), lengths=LENGTHS, samples=3, seed=7)


def test_same_seed_same_tasks_other_seed_other_tasks(tokenizer, tasks) -> None:
    again = generate_tasks(tokenizer, kinds=list(TaskKind), lengths=LENGTHS, samples=3, seed=7)
    assert again == tasks
    other = generate_tasks(tokenizer, kinds=list(TaskKind), lengths=LENGTHS, samples=3, seed=8)
    # Ids name the seed, so pooled seeds never collide; otherwise the same slots.
    assert [t.task_id.replace("-s8", "-s7") for t in other] == [t.task_id for t in tasks]
    assert {t.seed for t in other} == {8} and not {t.task_id for t in other} & {
        t.task_id for t in tasks
    }
    assert all(a.document != b.document for a, b in zip(other, tasks, strict=True))


def test_one_task_per_kind_length_and_sample(tasks) -> None:
    assert len(tasks) == len(LENGTHS) * len(TaskKind) * 3
    assert len({t.task_id for t in tasks}) == len(tasks)
    # Samples of one kind and length differ from each other.
    assert len({t.document for t in tasks}) == len(tasks)


def test_documents_fill_their_length_in_model_tokens(tokenizer, tasks) -> None:
    for task in tasks:
        n = len(tokenizer.encode_user_text(task.document).ids)
        assert 0.9 * task.target_tokens <= n <= task.target_tokens, (task.task_id, n)


@pytest.mark.parametrize("kind", [TaskKind.NEEDLE, TaskKind.MULTI_HOP])
def test_planted_facts_hold_the_answer(tasks, kind: TaskKind) -> None:
    for task in (t for t in tasks if t.kind is kind):
        (gold,) = task.gold
        for fact in task.facts:
            assert task.document.count(fact) == 1, (task.task_id, fact)
        # The answer is in the document only inside a planted fact (never in the filler).
        assert task.document.count(gold) == 1
        assert any(gold in fact for fact in task.facts)
        assert gold not in task.query


def test_multi_hop_facts_are_far_apart(tasks) -> None:
    for task in (t for t in tasks if t.kind is TaskKind.MULTI_HOP):
        assert len(task.facts) in (2, 3)
        positions = sorted(task.document.index(f) for f in task.facts)
        gaps = [b - a for a, b in itertools.pairwise(positions)]
        # Evenly spread over the document: each gap is a sizeable share of it.
        assert min(gaps) > len(task.document) / (2 * len(task.facts)), task.task_id
        # A distractor chain names another town: the only town in the text is not the answer.
        assert task.document.count(" is in ") == 2


def test_aggregation_gold_words_are_the_most_common(tasks) -> None:
    for task in (t for t in tasks if t.kind is TaskKind.AGGREGATION):
        words = [line.split(". ", 1)[1] for line in task.document.split("\n") if line]
        counts = Counter(words)
        assert set(task.vocabulary) == set(counts)
        top = counts.most_common()
        assert {w for w, _ in top[:COMMON_WORDS]} == set(task.gold)
        # A clear lead: the least common gold word beats every other word by a margin.
        assert top[COMMON_WORDS - 1][1] >= 2 * top[COMMON_WORDS][1], task.task_id


def _story(task: Task) -> list[str]:
    """The bAbI-style event sentences of a document, in order (filler has no names)."""
    sentences = task.document.replace("\n", " ").split(". ")
    return [
        s.strip().rstrip(".") + "."
        for s in sentences
        if s.strip()[:1].isupper() and s.strip().split(" ")[0] not in {"The", "A", "An"}
    ]


def test_babi_answers_follow_from_the_story(tasks) -> None:
    """Replaying the story's events in document order gives the gold room."""
    babi = [t for t in tasks if t.kind is TaskKind.BABI]
    assert babi and {t.query.startswith("Where is the ") for t in babi} == {True, False}
    for task in babi:
        (gold,) = task.gold
        assert gold in task.vocabulary and gold not in task.query
        room_of: dict[str, str] = {}
        holder: dict[str, str] = {}
        lies_in: dict[str, str] = {}
        for sentence in _story(task):
            words = sentence.rstrip(".").split(" ")
            person, last = words[0], words[-1]
            if last in task.vocabulary:
                room_of[person] = last
            elif any(verb in sentence for verb in ("picked up", "grabbed", "took", "got")):
                holder[last] = person
                lies_in.pop(last, None)
            else:  # dropped, put down, left, discarded
                lies_in[last] = room_of[holder.pop(last)]
        subject = task.query.removeprefix("Where is ").removeprefix("the ").rstrip("?")
        where = room_of.get(subject) or lies_in.get(subject) or room_of[holder[subject]]
        assert where == gold, (task.task_id, task.query, task.facts)
        # The supporting facts are in the document once each, in story order.
        positions = [task.document.index(f) for f in task.facts]
        assert positions == sorted(positions) and all(
            task.document.count(f) == 1 for f in task.facts
        )
        # Several events per story, spread over the document, with rooms visited more than once
        # (the older moves are distractors).
        assert len(_story(task)) >= 6 + task.target_tokens // 512
