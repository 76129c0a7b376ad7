"""Engine settings, validated once at the edge (CLI, serve config, tests)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A local Hugging Face model folder; None means the offline default (SmolLM2-135M-Instruct).
    model: str | None = None
    dtype: Literal["bfloat16", "float32", "float16", "auto"] = "bfloat16"
    max_model_len: int = Field(8192, ge=256)
    # KV cache size. On CPU this is the whole KV pool; set it explicitly so that several
    # engines can share a machine (vLLM would otherwise take 92% of RAM).
    kv_cache_gib: float = Field(1.0, gt=0)
    # CPU kernels need a multiple of 32. Small blocks let more segment ends fall on a block
    # boundary (a margin recomputes context tokens past its last full block).
    block_size: int = Field(32, ge=16)
    # Tokens per engine step; a large budget lets one step carry a whole segment's prefill
    # together with the margins' decodes.
    max_num_batched_tokens: int = Field(2048, ge=256)
    max_num_seqs: int = Field(128, ge=4)
    enable_prefix_caching: bool = True
    # Thread binding for the CPU worker: "all" (every core this process may use), "rank" (one
    # core per engine replica, by its rank on the node), or vLLM's own "auto"/"nobind"/"0-1".
    cpu_threads_bind: str = "all"
    enforce_eager: bool = True
    seed: int = 0
    # Admission control: how many documents may hold KV at once, and how long a new job may
    # wait for room before it is refused with OVERLOADED.
    max_sessions: int = Field(16, ge=1)
    admission_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.block_size % 16:
            raise ValueError("block_size must be a multiple of 16 (32 on CPU)")
        if self.max_num_seqs < 2 * self.max_sessions:
            raise ValueError(
                "max_num_seqs must be at least 2 x max_sessions: every parked document holds "
                "a sequence slot, and its margins need slots too"
            )
        return self
