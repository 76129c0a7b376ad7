"""Plain engine requests: a short prompt answered directly, without WiM.

The OpenAI-compatible API sends prompts below `RouterConfig.plain_prompt_tokens` this way
(`serving/openai/`). The request speaks the same event types as a WiM job (answer deltas, then
`done` with usage and timings), so the router places, streams and fails it over like one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from wim_service.engine.request_params import plain_request_blocks
from wim_service.wim.errors import WiMError
from wim_service.wim.events import AnswerEvent, DoneEvent, ErrorEvent, Timings, Usage, WiMEvent

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend


class PlainParams(BaseModel):
    """How a plain request generates (greedy, like every request of the service)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(..., ge=1)
    stop: list[str] = Field(default_factory=list)  # strings that end the answer (excluded)
    # The tenant's, or its end user's (`Tenant.salt_for`): its requests reuse each other's
    # prefix cache, never another's, so `cached_tokens` cannot tell one what another sent.
    cache_salt: str = Field(..., min_length=1)


def plain_blocks(prompt_tokens: int, params: PlainParams, block_size: int) -> int:
    """KV blocks a plain request holds at most (what the router places it by)."""
    return plain_request_blocks(prompt_tokens, params.max_tokens, block_size)


async def plain_events(
    backend: VLLMBackend, prompt_ids: list[int], params: PlainParams
) -> AsyncIterator[WiMEvent]:
    """One plain request on `backend` as events; leaving early aborts it."""
    started = time.perf_counter()
    timings = Timings()
    pieces: list[str] = []
    answer_tokens = cached = 0
    try:
        async for chunk in backend.stream_complete(
            prompt_ids,
            max_tokens=params.max_tokens,
            stop=params.stop,
            cache_salt=params.cache_salt,
            reserve=True,
        ):
            if chunk.cost is not None:
                cached = chunk.cost.cached
            answer_tokens += len(chunk.token_ids)
            if chunk.text:
                timings.answer_ttft_s = timings.answer_ttft_s or time.perf_counter() - started
                pieces.append(chunk.text)
                yield AnswerEvent(text=chunk.text)
    except WiMError as exc:
        yield ErrorEvent.of(exc)
        return
    timings.total_s = time.perf_counter() - started
    submitted = len(prompt_ids)
    yield DoneEvent(
        answer="".join(pieces),
        usage=Usage(
            prompt_tokens_submitted=submitted,
            prompt_tokens_cached=cached,
            prompt_tokens_computed=submitted - cached,
            minimal_prompt_tokens=submitted,
            answer_tokens=answer_tokens,
        ),
        timings=timings,
    )
