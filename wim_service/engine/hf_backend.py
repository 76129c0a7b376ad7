"""The plain-transformers reference backend: the same WiM algorithm on a `DynamicCache`.

One cache per context, extended segment by segment; a branch appends its suffix, decodes, then
crops the cache back (the margin leaves no trace). It runs one operation at a time, so the
orchestrator writes each margin before pushing the next segment, like the reference
implementation. It is the parity oracle in tests and the baseline in `wim bench`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wim_service.wim.backend import (
    NOT_STORED,
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    KVRestore,
    PromptCost,
    StoredDocument,
)
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from wim_service.engine.config import EngineConfig


class HFBackend:
    """Implements `wim.backend.Backend` with transformers, greedy decoding, batch size 1."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 8192,
        block_size: int = 32,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype)
        ).eval()
        self.tokenizer = HFTokenizer(model_dir)
        # Same block size as the engine it is compared with: segmentation is then identical.
        self.limits = EngineLimits(max_model_len, block_size, concurrent_branches=False)
        self._lock = threading.Lock()  # one forward pass at a time across contexts

    @classmethod
    def from_config(cls, config: EngineConfig) -> HFBackend:
        """The reference for an engine with `config`: same model, dtype, window and blocks."""
        from wim_service.assets.default_model import default_model_dir

        return cls(
            config.model or default_model_dir(),
            dtype=config.cpu_dtype(),
            max_model_len=config.max_model_len,
            block_size=config.block_size,
        )

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> HFContext:
        return HFContext(self)  # the reference keeps no KV store: `stored` changes nothing

    def forward(self, ids: list[int], cache: Any) -> Any:
        """Run `ids` through the model on `cache`; returns the last position's logits."""
        torch = self.torch
        with self._lock, torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[0, -1].float()

    def decode(self, logits: Any, cache: Any, params: GenerationParams) -> Iterator[int]:
        """Greedy decoding from `logits` (the prompt's last position) until a stop."""
        torch = self.torch
        for step in range(params.max_tokens):
            if step == 0 and params.first_token_ids:
                allowed = torch.tensor(sorted(params.first_token_ids))
                token = int(allowed[logits[allowed].argmax()])
            else:
                token = int(logits.argmax())
            yield token
            if token in params.stop_token_ids or step + 1 == params.max_tokens:
                return
            logits = self.forward([token], cache)


async def _iterate(items: Iterator[int], cost: PromptCost) -> AsyncIterator[GenerationChunk]:
    """Drive a blocking token iterator from a worker thread, one chunk per token."""
    first = True
    sentinel = object()
    while True:
        token = await asyncio.to_thread(next, items, sentinel)
        if not isinstance(token, int):  # the sentinel: the generation ended
            yield GenerationChunk([], True, cost if first else None, "stop")
            return
        yield GenerationChunk([token], False, cost if first else None)
        first = False


class HFContext:
    def __init__(self, backend: HFBackend) -> None:
        from transformers import DynamicCache

        self.backend = backend
        self.cache = DynamicCache()
        self._ids: list[int] = []

    @property
    def context_tokens(self) -> int:
        return len(self._ids)

    async def restore(self, token_ids: list[int]) -> KVRestore:
        return NOT_STORED

    def _check_room(self, total: int) -> None:
        if total > self.backend.limits.max_model_len:
            raise WiMError(ErrorCode.TOO_LONG, "the job does not fit the context window")

    async def extend(self, token_ids: list[int]) -> PromptCost:
        self._check_room(len(self._ids) + len(token_ids))
        await asyncio.to_thread(self.backend.forward, token_ids, self.cache)
        self._ids.extend(token_ids)
        return PromptCost(len(token_ids), 0)

    def _crop(self, length: int) -> None:
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            # crop(-k) drops the last k positions (positive crop(n) is deprecated in 5.x).
            self.cache.crop(-excess)

    async def branch(
        self, prefix_tokens: int, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        if prefix_tokens != len(self._ids):
            raise ValueError("the reference backend branches only at the context's end")
        self._check_room(prefix_tokens + len(suffix_ids) + params.max_tokens)
        try:
            logits = await asyncio.to_thread(self.backend.forward, suffix_ids, self.cache)
            tokens = self.backend.decode(logits, self.cache, params)
            cost = PromptCost(prefix_tokens + len(suffix_ids), prefix_tokens)
            async for chunk in _iterate(tokens, cost):
                yield chunk
        finally:
            self._crop(prefix_tokens)

    async def conclude(
        self, suffix_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.branch(len(self._ids), suffix_ids, params):
            yield chunk

    async def generate(
        self, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[GenerationChunk]:
        from transformers import DynamicCache

        cache = DynamicCache()
        logits = await asyncio.to_thread(self.backend.forward, prompt_ids, cache)
        async for chunk in _iterate(
            self.backend.decode(logits, cache, params), PromptCost(len(prompt_ids), 0)
        ):
            yield chunk

    @contextlib.asynccontextmanager
    async def reserve_more(self, blocks: int, *, wait: bool = True) -> AsyncIterator[bool]:
        yield True  # the reference backend has no shared KV pool to reserve from

    async def close(self) -> None:
        self.cache = None  # frees the KV; the context is over
