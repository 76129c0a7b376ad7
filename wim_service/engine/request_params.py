"""What every engine request is made of, decided in one place: its priority, its
`SamplingParams`, and the bounds checked before it is submitted (the window, its KV blocks).

WiM context pushes, branches and conclusions and plain (salt-free) completions all go through
here, so that a change to how the service samples or refuses a request reaches every request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wim_service.wim.backend import RequestKind
from wim_service.wim.errors import ErrorCode, WiMError

if TYPE_CHECKING:
    from vllm import SamplingParams

# Lower runs first. Answers and margins jump ahead of context pushes, so a parked session's
# margins never wait behind another document's prefill (and cannot deadlock behind it).
PRIORITY = {
    RequestKind.ANSWER: 0,
    RequestKind.CLASSIFIER: 0,
    RequestKind.MARGIN: 1,
    RequestKind.CONTEXT: 2,
}


def sampling_params(
    max_tokens: int,
    *,
    stop_token_ids: Iterable[int] = (),
    stop: Sequence[str] = (),
    first_token_ids: Iterable[int] | None = None,
    exact_tokens: bool = False,
    detokenize: bool = False,
) -> SamplingParams:
    """Greedy sampling streamed as deltas: every request of the service samples this way.

    `first_token_ids` restricts the first token (`first_token.FirstTokenChoice`); `exact_tokens`
    forces `max_tokens` tokens (timing comparisons at a fixed answer length). Only requests
    whose text is read (plain completions, `stop` strings) pay for `detokenize`: WiM works on
    token ids.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from wim_service.engine.first_token import FIRST_TOKEN_IDS_KEY

    extra: dict[str, Any] | None = None
    if first_token_ids:
        extra = {FIRST_TOKEN_IDS_KEY: sorted(first_token_ids)}
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=max_tokens if exact_tokens else 0,
        ignore_eos=exact_tokens,
        stop_token_ids=sorted(stop_token_ids),
        stop=list(stop) or None,
        output_kind=RequestOutputKind.DELTA,
        detokenize=detokenize,
        extra_args=extra,
    )


def check_window(tokens: int, max_model_len: int, what: str) -> None:
    """Refuse a request of `tokens` (prompt and generation) past the model's window before it
    reaches the engine: a session that outgrows `max_model_len` kills the whole engine (vLLM
    #42489), not just the request."""
    if tokens > max_model_len:
        raise WiMError(
            ErrorCode.TOO_LONG,
            f"{what} would need {tokens} tokens; the model's context window is {max_model_len}",
        )


def plain_request_blocks(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a plain request holds at most: its prompt and every token it may generate.

    What the engine reserves for it in admission control and the router places it by."""
    return -(-(prompt_tokens + max_tokens) // block_size)
