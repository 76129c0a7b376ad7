"""Scorers, invented values, intervals and paired comparisons on known cases; BM25 retrieval."""

from __future__ import annotations

import pytest

from wim_service.eval.methods import MethodResult, retrieve
from wim_service.eval.report import Interval, bootstrap, compare, markdown, summarize
from wim_service.eval.runner import RunRecord
from wim_service.eval.scoring import exact_match, hallucinated_values, normalize, score, token_f1
from wim_service.eval.tasks import Task, TaskKind, generate_tasks


def test_normalize_drops_case_punctuation_and_articles() -> None:
    assert normalize("The Access-code is: 4417!") == ["access", "code", "is", "4417"]


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("The access code for the north gate is 4417.", "4417", 1.0),
        ("4417", "4417", 1.0),
        ("The code is 44170.", "4417", 0.0),  # whole words only
        ("The code is 4471.", "4417", 0.0),
        ("She works in Belmora.", "Belmora", 1.0),
        ("She works in Belmor.", "Belmora", 0.0),
        ("", "4417", 0.0),
        ("the north bakery", "North Bakery", 1.0),
    ],
)
def test_exact_match(answer: str, gold: str, expected: float) -> None:
    assert exact_match(answer, gold) == expected


def test_token_f1_known_values() -> None:
    assert token_f1(["a", "b"], ["a", "b"]) == 1.0
    assert token_f1(["x"], ["a"]) == 0.0
    assert token_f1([], ["a"]) == 0.0
    # precision 1/2, recall 1/3 -> F1 = 2 * (1/6) / (5/6) = 0.4
    assert token_f1(["a", "z"], ["a", "b", "c"]) == pytest.approx(0.4)


def _aggregation(gold: tuple[str, ...], vocabulary: set[str]) -> Task:
    return Task("t", TaskKind.AGGREGATION, 100, "", "q", gold, vocabulary=frozenset(vocabulary))


def test_aggregation_counts_list_words_once_each() -> None:
    task = _aggregation(("belto", "marik", "sune"), {"belto", "marik", "sune", "tova", "zim"})
    perfect = score(task, "The most common words are: Belto, marik, sune.")
    assert (perfect.exact, perfect.f1) == (1.0, 1.0)
    assert perfect.primary(TaskKind.AGGREGATION) == 1.0
    # Two right, one wrong, a repeat (ignored), non-list words (ignored): P 2/3, R 2/3.
    partial = score(task, "belto, belto, marik, tova and the word common")
    assert partial.exact == 0.0
    assert partial.f1 == pytest.approx(2 / 3)
    assert score(task, "I cannot tell.").f1 == 0.0


def test_question_answering_is_judged_by_exact_match() -> None:
    task = Task("t", TaskKind.NEEDLE, 100, "", "q", ("4417",))
    marks = score(task, "The access code is 4417.")
    assert marks.exact == 1.0
    assert 0 < marks.f1 < 1  # the surrounding words cost precision
    assert marks.primary(TaskKind.NEEDLE) == 1.0


def test_bm25_finds_the_needle_segment(tokenizer) -> None:
    tasks = generate_tasks(tokenizer, kinds=[TaskKind.NEEDLE], lengths=[4096], samples=5, seed=3)
    for task in tasks:
        excerpts = retrieve(tokenizer, task.document, task.query, chunk_tokens=256, top_k=1)
        assert len(excerpts) == 1
        assert task.facts[0] in excerpts[0], task.task_id
        assert len(tokenizer.encode_user_text(excerpts[0]).ids) <= 384


def test_bm25_keeps_document_order(tokenizer) -> None:
    (task,) = generate_tasks(
        tokenizer, kinds=[TaskKind.MULTI_HOP], lengths=[2048], samples=1, seed=1
    )
    excerpts = retrieve(tokenizer, task.document, task.query, chunk_tokens=128, top_k=4)
    assert len(excerpts) == 4
    positions = [task.document.index(e) for e in excerpts]
    assert positions == sorted(positions)


def test_babi_answer_must_name_the_room_and_no_other() -> None:
    rooms = frozenset({"kitchen", "garden", "hallway"})
    task = Task("t", TaskKind.BABI, 100, "", "Where is Kel?", ("garden",), vocabulary=rooms)
    assert score(task, "Kel is in the garden.").primary(TaskKind.BABI) == 1.0
    assert score(task, "Kel went to the kitchen, then the garden.").primary(TaskKind.BABI) == 0.0
    assert score(task, "Kel is in the hallway.").primary(TaskKind.BABI) == 0.0


def test_hallucinated_values_are_numbers_and_names_not_in_the_document() -> None:
    document = "The access code for the night gate is 4417. Tomas Reyes leads the pilots."
    task = Task("t", TaskKind.NEEDLE, 100, document, "What is the code for Salt Lane?", ("4417",))
    assert hallucinated_values("The access code for the night gate is 4417.", task) == []
    assert hallucinated_values("The code is 123456, says Tomas Reyes.", task) == ["123456"]
    assert hallucinated_values("Ask Marta Reyes at Salt Lane.", task) == ["marta"]
    assert hallucinated_values("It is 4,417 or 1,240.", task) == ["1240"]


def _record(task_id: str, kind: TaskKind, method: str, score_: float, invented=()) -> RunRecord:
    result = MethodResult("answer", 100, 10, 1.0)
    return RunRecord(
        task_id, kind, 1024, method, ["x"], score_, score_, score_, result, list(invented)
    )


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_more_tasks() -> None:
    few = bootstrap([1.0, 0.0] * 5)
    many = bootstrap([1.0, 0.0] * 50)
    assert few.mean == many.mean == 0.5
    assert few.low < many.low < 0.5 < many.high < few.high
    assert bootstrap([0.3] * 7) == Interval(0.3, 0.3, 0.3, 7)
    assert bootstrap([]).n == 0 and str(bootstrap([])) == "-"


def test_paired_comparison_counts_wins_on_the_same_tasks() -> None:
    records = []
    for i in range(40):
        kind = TaskKind.NEEDLE if i % 2 else TaskKind.BABI
        records.append(_record(f"t{i}", kind, "plain", 0.0, ["9999"] if i < 10 else []))
        # WiM wins the 20 needle tasks, ties the bAbI ones.
        records.append(_record(f"t{i}", kind, "wim", 1.0 if i % 2 else 0.0))
    (paired,) = compare(records)
    assert (paired.wins, paired.ties, paired.losses) == (20, 20, 0)
    assert paired.by_kind["needle"].mean == 1.0 and paired.by_kind["babi"].mean == 0.0
    assert paired.mean_difference.mean == 0.5 and paired.mean_difference.low > 0
    summary = {s.method: s for s in summarize(records)}
    assert summary["plain"].hallucination_rate == 0.25 and summary["wim"].hallucination_rate == 0
    table = markdown(records, title="t")
    assert "| wim | +1.00 [+1.00, +1.00] | +0.00 [+0.00, +0.00] |" in table
    assert "20 / 20 / 0" in table
