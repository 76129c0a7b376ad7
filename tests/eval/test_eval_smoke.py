"""End to end on the real engine: every method on two small tasks, then the three reports."""

from __future__ import annotations

import json

import pytest

from wim_service.benchmarks.engine import plain_call
from wim_service.eval.methods import METHODS, MethodSettings
from wim_service.eval.report import write_report
from wim_service.eval.runner import evaluate
from wim_service.eval.scoring import hallucinated_values
from wim_service.eval.sizing import largest_length
from wim_service.eval.tasks import TaskKind, generate_tasks
from wim_service.wim.grounding import query_overlap
from wim_service.wim.options import PromptTemplates, WiMOptions
from wim_service.wim.prompts import PromptBuilder

pytestmark = pytest.mark.engine

LENGTH = 768
SETTINGS = MethodSettings(
    WiMOptions(segment_tokens=256, margin_max_tokens=32, answer_max_tokens=32),
    rag_chunk_tokens=128,
    rag_top_k=2,
)


async def test_smoke_evaluation_produces_sane_reports(engine, tmp_path) -> None:
    tasks = generate_tasks(
        engine.tokenizer,
        kinds=[TaskKind.NEEDLE, TaskKind.BABI],
        lengths=[LENGTH],
        samples=1,
        seed=0,
    )
    methods = list(METHODS)
    records = await evaluate(engine, tasks, methods, SETTINGS)
    assert len(records) == len(tasks) * len(methods)
    assert all(r.result.error is None for r in records)
    for r in records:
        assert 0.0 <= r.score <= 1.0 and r.result.answer
        assert r.result.generated_tokens > 0 and r.result.wall_s > 0
    by = {(r.task_id, r.method): r for r in records}
    for task in tasks:
        doc_tokens = len(engine.tokenizer.encode_user_text(task.document).ids)
        plain, rag = by[task.task_id, "plain"].result, by[task.task_id, "rag"].result
        # Plain computes the document (the shared system prompt may come from the cache);
        # RAG computes two ~128-token chunks instead; WiM computes the document once, plus its
        # margin instructions and margins.
        assert doc_tokens <= plain.prompt_tokens_computed <= doc_tokens + 200
        assert rag.prompt_tokens_computed < plain.prompt_tokens_computed - 200
        for mode in ("first_token", "classifier", "none"):
            wim = by[task.task_id, f"wim_{mode}"].result
            assert wim.prompt_tokens_computed > doc_tokens
            assert wim.generated_tokens >= len(wim.margins) + 1  # a token per margin at least
            assert [m.segment for m in wim.margins] == list(range(len(wim.margins)))
            assert len(wim.margins) >= 2  # 768 tokens in ~256-token segments
        # Keep-all marks every non-empty margin relevant; grounding keeps only grounded ones
        # that share enough of the question, and a kept note's evidence is the document's text.
        assert all(m.relevant for m in by[task.task_id, "wim_none"].result.margins if m.text)
        threshold = SETTINGS.options.note_min_query_overlap
        for m in by[task.task_id, "wim_none"].result.margins:
            overlap = query_overlap(task.query, m.evidence)
            assert m.kept == (m.relevant and m.grounded and overlap >= threshold)
            assert m.evidence in task.document if m.grounded else m.evidence == ""
        assert all(m.kept == m.relevant for m in by[task.task_id, "wim_ungrounded"].result.margins)

    paths = write_report(records, tmp_path, {"test": True}, title="smoke")
    table = paths["markdown"].read_text()
    for method in methods:
        assert f"| {method} |" in table
    assert "Paired difference from plain" in table and "invented" in table
    data = json.loads(paths["json"].read_text())
    assert data["config"] == {"test": True}
    assert len(data["records"]) == len(records)
    summary = {s["method"]: s for s in data["summary"]}
    assert set(summary) == set(methods)
    assert all(0 <= s["mean_score"]["mean"] <= 1 and s["errors"] == 0 for s in summary.values())
    assert summary["rag"]["prompt_tokens_computed"] < summary["plain"]["prompt_tokens_computed"]
    assert set(data["by_length"]) == {"needle", "babi"}
    assert {p["method"] for p in data["paired"]} == set(methods) - {"plain"}
    tasks_by_id = {t.task_id: t for t in tasks}
    for r in data["records"]:
        answer = r["result"]["answer"]
        assert r["hallucinated"] == hallucinated_values(answer, tasks_by_id[r["task_id"]])
    png = paths["png"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_largest_length_leaves_room_for_the_worst_request(tokenizer) -> None:
    options = WiMOptions()
    longest = largest_length(8192, options, tokenizer)
    # Notes are budgeted to the window, so WiM reads what a plain call reads, minus prompts.
    assert 7168 <= longest < 8192 and longest % 256 == 0
    assert largest_length(4096, options, tokenizer) < 4096 - options.answer_max_tokens
    bigger = WiMOptions(margin_max_tokens=1000)
    assert largest_length(8192, bigger, tokenizer) < longest


async def test_complete_reports_tokens_and_cache_hits(engine) -> None:
    """The ordinary request behind plain, RAG and `wim bench`'s plain call."""
    builder = PromptBuilder(engine.tokenizer, PromptTemplates())
    document = "The lighthouse keeper paints the door green every spring. " * 8
    prompt = builder.plain_prompt(
        engine.tokenizer.encode_user_text(document).ids, "What colour is the door?"
    )
    forced = await engine.complete(prompt, max_tokens=12, exact_tokens=True)
    assert len(forced.token_ids) == 12 and forced.seconds > 0
    free = await engine.complete(prompt, max_tokens=40)
    assert "green" in free.text.lower()
    assert free.token_ids[-1] in engine.tokenizer.eos_token_ids or len(free.token_ids) == 40
    # The same prompt again: every full KV block of it comes from the prefix cache.
    block = engine.limits.block_size
    assert free.cost.submitted == len(prompt)
    assert free.cost.cached == len(prompt) // block * block or free.cost.cached == (
        (len(prompt) - 1) // block * block
    )
    assert await plain_call(engine, document, "What colour is the door?", WiMOptions(), 4) > 0
