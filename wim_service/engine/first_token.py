"""A vLLM logits processor that restricts a request's *first* generated token to a set of ids.

Relevance mode `first_token` asks the margin to open with YES or NO. A 135M model drifts
unless forced, and `allowed_token_ids` would restrict every token, not just the first.
Requests opt in with `SamplingParams.extra_args[FIRST_TOKEN_IDS_KEY] = [ids...]`.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FIRST_TOKEN_IDS_KEY = "wim_first_token_ids"


class FirstTokenChoice(AdapterLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        ids = (sampling_params.extra_args or {}).get(FIRST_TOKEN_IDS_KEY)
        if ids is not None and (
            not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids)
        ):
            raise ValueError(f"{FIRST_TOKEN_IDS_KEY} must be a non-empty list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        ids = (params.extra_args or {}).get(FIRST_TOKEN_IDS_KEY)
        if not ids:
            return None
        allowed = torch.tensor(sorted(ids), dtype=torch.long)

        def restrict(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if output_ids:
                return logits
            masked = torch.full_like(logits, float("-inf"))
            index = allowed.to(logits.device)
            masked[index] = logits[index]
            return masked

        return restrict
