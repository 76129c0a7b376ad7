"""vLLM and the plain-transformers reference run the same algorithm to the same tokens."""

from __future__ import annotations

import pytest

from tests.conftest import TEST_ENGINE
from wim_service.engine.hf_backend import HFBackend
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.plan import plan_document
from wim_service.wim.prompts import PromptBuilder

pytestmark = [pytest.mark.engine, pytest.mark.reference]


@pytest.fixture(scope="module")
def reference(model_dir) -> HFBackend:
    return HFBackend(
        model_dir,
        dtype="float32",
        max_model_len=TEST_ENGINE.max_model_len,
        block_size=TEST_ENGINE.block_size,
    )


async def outcome(backend, document: str, query: str, options: WiMOptions) -> dict:
    events = [e async for e in run_wim(backend, backend.tokenizer, document, query, options)]
    assert events[-1].type == "done", events[-1]
    margins = sorted((e.segment, e.relevant, e.text) for e in events if e.type == "margin")
    return {"margins": margins, "answer": events[-1].answer, "usage": events[-1].usage}


@pytest.mark.parametrize("relevance", [RelevanceMode.FIRST_TOKEN, RelevanceMode.CLASSIFIER])
async def test_vllm_equals_reference(engine, reference, short_report, relevance) -> None:
    options = WiMOptions(
        relevance=relevance,
        segment_tokens=96,
        margin_max_tokens=20,
        answer_max_tokens=24,
        skip_unmatched_segments=False,  # every margin written, on both backends
    )
    query = "How many days was the harbour mouth closed this winter?"
    fast = await outcome(engine, short_report, query, options)
    slow = await outcome(reference, short_report, query, options)
    assert fast["usage"].segments >= 3
    assert fast["margins"] == slow["margins"]
    assert fast["answer"] == slow["answer"]
    # Same work, different cost: the engine served most context tokens from its cache.
    assert fast["usage"].minimal_prompt_tokens == slow["usage"].minimal_prompt_tokens
    # Every margin read every full KV block of the context before it from the cache.
    plan = plan_document(
        PromptBuilder(engine.tokenizer, options.prompts), short_report, options, engine.limits
    )
    block = engine.limits.block_size
    margin_hits = sum((len(plan.prefix_ids) + s.token_end) // block * block for s in plan.segments)
    assert fast["usage"].prompt_tokens_cached >= margin_hits
