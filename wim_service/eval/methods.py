"""The methods compared, each on the same engine, model, prompts and answer budget.

* `plain`: the whole document, then the final step with no notes (the WiM final prompt with an
  empty margin list, so the *only* difference from WiM is the margins).
* `rag`: the document cut into chunks at sentence ends, the BM25 top-k chunks (in document
  order) in place of the document, then the same final step.
* `wim_<mode>`: `run_wim` with relevance mode `first_token`, `classifier` or `none` (and the
  run's grounding mode, `snap` by default).
* `wim_ungrounded`: `run_wim` with the run's relevance mode and grounding `off`: WiM as it was
  before grounding, for comparison in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wim_service.eval.tasks import Task
from wim_service.wim.options import GroundingMode, RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.segmentation import segment_document
from wim_service.wim.tokenizer import Tokenizer

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import Completion, VLLMBackend


@dataclass(frozen=True)
class MethodSettings:
    """Knobs shared by every task of a run."""

    options: WiMOptions = field(default_factory=WiMOptions)
    rag_chunk_tokens: int = 256
    rag_top_k: int = 3


@dataclass(frozen=True)
class Margin:
    segment: int
    text: str
    relevant: bool
    grounded: bool
    kept: bool
    evidence: str
    skipped: bool  # not written: no sentence window of the segment was near the query
    cut_short: bool  # stopped once no continuation could be kept


@dataclass(frozen=True)
class MethodResult:
    """One method's answer to one task and its cost."""

    answer: str
    prompt_tokens_computed: int
    generated_tokens: int
    wall_s: float
    margins: list[Margin] = field(default_factory=list)
    error: str | None = None


MethodFn = Callable[["VLLMBackend", Task, MethodSettings], Awaitable[MethodResult]]


def retrieve(
    tokenizer: Tokenizer, document: str, query: str, *, chunk_tokens: int, top_k: int
) -> list[str]:
    """The `top_k` BM25 chunks of `document` for `query`, in document order.

    Chunks come from the WiM segmenter (sentence ends, model tokens), so RAG and WiM see the
    same kind of pieces; order is restored so the excerpts read like the document.
    """
    import bm25s

    encoded = tokenizer.encode_user_text(document)
    segments = segment_document(
        document,
        encoded,
        target_tokens=chunk_tokens,
        max_tokens=chunk_tokens + chunk_tokens // 2,
        block_size=1,  # no KV alignment to prefer: chunks are never cached
        prefix_tokens=0,
    )
    chunks = [document[s.char_start : s.char_end].strip() for s in segments]
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(chunks, stopwords="en", show_progress=False), show_progress=False
    )
    query_tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
    found, _ = retriever.retrieve(query_tokens, k=min(top_k, len(chunks)), show_progress=False)
    return [chunks[i] for i in sorted(int(i) for i in found[0])]


async def _answer_over(
    backend: VLLMBackend, text: str, task: Task, settings: MethodSettings
) -> Completion:
    """The final step (no notes) over `text`: what plain and RAG share."""
    options = settings.options
    builder = PromptBuilder(backend.tokenizer, options.prompts)
    prompt = builder.plain_prompt(backend.tokenizer.encode_user_text(text).ids, task.query)
    return await backend.complete(
        prompt,
        max_tokens=options.answer_max_tokens,
        stop_token_ids=frozenset(options.stop_token_ids),
    )


async def plain(backend: VLLMBackend, task: Task, settings: MethodSettings) -> MethodResult:
    completion = await _answer_over(backend, task.document, task, settings)
    return MethodResult(
        completion.text, completion.cost.computed, len(completion.token_ids), completion.seconds
    )


async def rag(backend: VLLMBackend, task: Task, settings: MethodSettings) -> MethodResult:
    started = time.perf_counter()
    excerpts = retrieve(
        backend.tokenizer,
        task.document,
        task.query,
        chunk_tokens=settings.rag_chunk_tokens,
        top_k=settings.rag_top_k,
    )
    completion = await _answer_over(backend, "\n\n".join(excerpts), task, settings)
    return MethodResult(
        completion.text,
        completion.cost.computed,
        len(completion.token_ids),
        time.perf_counter() - started,
    )


def wim(
    mode: RelevanceMode | None = None,
    grounding: GroundingMode | None = None,
    note_min_query_overlap: float | None = None,
) -> MethodFn:
    """WiM with relevance mode `mode`, grounding `grounding` and the notes' query-overlap
    filter (None: the run's options); margins are kept for the report."""

    async def run(backend: VLLMBackend, task: Task, settings: MethodSettings) -> MethodResult:
        update = {
            "relevance": mode,
            "grounding": grounding,
            "note_min_query_overlap": note_min_query_overlap,
        }
        options = settings.options.model_copy(
            update={k: v for k, v in update.items() if v is not None}
        )
        started = time.perf_counter()
        margins: list[Margin] = []
        async for event in run_wim(backend, backend.tokenizer, task.document, task.query, options):
            if event.type == "margin":
                margins.append(
                    Margin(
                        event.segment,
                        event.text,
                        event.relevant,
                        event.grounded,
                        event.kept,
                        event.evidence,
                        event.skipped,
                        event.cut_short,
                    )
                )
            elif event.type == "error":
                return MethodResult("", 0, 0, time.perf_counter() - started, margins, event.message)
            elif event.type == "done":
                u = event.usage
                return MethodResult(
                    event.answer,
                    u.prompt_tokens_computed,
                    u.margin_tokens + u.answer_tokens + u.discarded_answer_tokens,
                    time.perf_counter() - started,
                    sorted(margins, key=lambda m: m.segment),
                )
        raise RuntimeError("the WiM job ended without a done or error event")

    return run


METHODS: dict[str, MethodFn] = {
    "plain": plain,
    "rag": rag,
    **{f"wim_{mode.value}": wim(mode) for mode in RelevanceMode},
    # WiM as it was before grounded margins: no grounding, no query-overlap filter.
    "wim_ungrounded": wim(grounding=GroundingMode.OFF, note_min_query_overlap=0.0),
}
