"""The tests' engine profile: fixed costs of a 135M model on a 2-core CPU with 23,000 KV
tokens per replica. The shipped profile is replaced by measurements, which must not change what
the placement and simulator tests find."""

from __future__ import annotations

from typing import Any

from wim_service.placement.profile import EngineProfile

PROFILE_FIELDS: dict[str, Any] = {
    "model": "test",
    "dtype": "float32",
    "machine": "tests",
    "measured_at": "never",
    "load_average": [0, 0, 0],
    "block_tokens": 32,
    "kv_capacity_tokens": 23000,
    "max_batch": 128,
    "margin_prompt_tokens": 60,
    "prefill": {"fixed_s": 0.02, "per_token_s": 3e-4, "per_token_context_s": 1e-8},
    "decode": {"fixed_s": 0.02, "per_sequence_s": 1e-3, "per_context_token_s": 1e-7},
    "query_extra_tokens": 50,
}
PROFILE = EngineProfile.model_validate(PROFILE_FIELDS)
