"""WiM contexts and plain requests on one vLLM `AsyncLLM` (V1 engine, vLLM 0.32).

`VLLMBackend` starts the engine, admits WiM contexts (`vllm_context.VLLMContext`, where the
mechanism is described) and plain salt-free completions, and asks the engine core's scheduler
(`scheduler.WiMScheduler`) for KV statistics and purges. What every request is made of
(priority, sampling, the window and KV bounds) is decided in `request_params`.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wim_service.engine import kv_memory
from wim_service.engine.admission import AdmissionLoad, KVAdmission
from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import DocumentKV, store_url
from wim_service.engine.kv_transfer.keys import StoredDocument
from wim_service.engine.process_env import configure_process_env, start_async_llm
from wim_service.engine.request_params import (
    PRIORITY,
    check_window,
    plain_request_blocks,
    sampling_params,
)
from wim_service.engine.timeline import TIMELINE_SPANS, RequestSpan
from wim_service.engine.vllm_context import VLLMContext
from wim_service.wim.backend import EngineLimits, PromptCost, RequestKind
from wim_service.wim.capacity import kept_free_blocks
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


@dataclass(frozen=True)
class KVStats:
    """The engine core's KV cache as its scheduler counts it (`WiMScheduler.wim_kv_stats`)."""

    free_blocks: int
    total_blocks: int
    cached_blocks: int
    parked_sessions: int


@dataclass(frozen=True)
class Completion:
    """One ordinary (salt-free) request's output and what it cost."""

    text: str
    token_ids: list[int]
    cost: PromptCost
    seconds: float


@dataclass(frozen=True)
class CompletionChunk:
    """New output of a streamed ordinary request. `cost` is set on the first chunk."""

    text: str  # decoded by vLLM (stop strings cut, incomplete characters held back)
    token_ids: list[int]
    cost: PromptCost | None
    finish_reason: str | None


class VLLMBackend:
    """Implements `wim.backend.Backend` over one `AsyncLLM` shared by many jobs."""

    def __init__(self, engine: AsyncLLM, config: EngineConfig, tokenizer: HFTokenizer) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        cache = engine.vllm_config.cache_config
        self.limits = EngineLimits(
            max_model_len=engine.model_config.max_model_len,
            block_size=cache.block_size,
            concurrent_branches=True,
        )
        # vLLM's block 0 is a null block that never holds KV.
        capacity = (cache.num_gpu_blocks or 0) - 1
        self.admission = KVAdmission(
            capacity,
            config.max_sessions,
            config.admission_timeout_s,
            keep_free_blocks=kept_free_blocks(capacity, config.side_by_side_kv_reserve),
        )
        self._ids = itertools.count()
        # Every context request's span, for tests and debugging (a deque append per request).
        self.timeline: deque[RequestSpan] = deque(maxlen=TIMELINE_SPANS)
        # This process's own access to the KV store (deletes, size); None without a store.
        self.kv_store = DocumentKV.from_env() if engine.vllm_config.kv_transfer_config else None
        self._kv_signature: dict[str, Any] | None = None  # the connector's, asked once

    @classmethod
    def start(cls, config: EngineConfig, *, rank: int = 0) -> VLLMBackend:
        """Build the engine (spawns the engine-core process: call under `__main__` guards).

        `rank` is this engine's index among the engines of one machine (thread binding).
        """
        from wim_service.assets.default_model import default_model_dir
        from wim_service.assets.paths import force_offline

        force_offline()
        configure_process_env(config, rank)
        from vllm import AsyncEngineArgs
        from vllm.config import KVTransferConfig
        from vllm.platforms import current_platform

        from wim_service.engine.kv_transfer.connector import connector_config

        model = config.model or str(default_model_dir())
        args = AsyncEngineArgs(
            model=model,
            # On a GPU, vLLM's "auto" (the model's dtype) stays.
            dtype=config.cpu_dtype() if current_platform.is_cpu() else config.dtype,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            scheduling_policy="priority",
            scheduler_cls="wim_service.engine.scheduler.WiMScheduler",
            worker_extension_cls=kv_memory.EXTENSION,
            logits_processors=["wim_service.engine.first_token:FirstTokenChoice"],
            kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30),
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            disable_log_stats=False,
            # Stored document KV (docs/kv-store.md): the connector reads its store from the
            # environment `configure_process_env` set.
            kv_transfer_config=KVTransferConfig(**connector_config()) if store_url() else None,
        )
        engine = start_async_llm(args)
        tokenizer = HFTokenizer(model, template_special_tokens=config.template_special_tokens)
        return cls(engine, config, tokenizer)

    def shutdown(self) -> None:
        self.engine.shutdown()
        # AsyncLLM.__del__ shuts down again; at interpreter exit that raises from half-torn
        # module globals, so drop the engine while the interpreter is whole.
        del self.engine
        gc.collect()

    @property
    def healthy(self) -> bool:
        return not self.engine.errored

    @property
    def dtype(self) -> str:
        """The dtype the model runs in, as an `EngineProfile` names it ("bfloat16")."""
        return str(self.engine.model_config.dtype).removeprefix("torch.")

    def next_request_id(self, salt: str, kind: str) -> str:
        return f"{salt}-{kind}-{next(self._ids)}"

    async def open_context(
        self, *, reserve_blocks: int, stored: StoredDocument | None = None
    ) -> VLLMContext:
        """A new context. With `stored` (set by the service, never by a client), its document
        pushes are saved to the KV store and `VLLMContext.restore` can load them elsewhere;
        without a KV store configured, `stored` changes nothing."""
        if not self.healthy:
            raise WiMError(ErrorCode.ENGINE_ERROR, "the engine is not running")
        await self.admission.acquire(reserve_blocks)
        return VLLMContext(self, reserve_blocks, stored if self.kv_store else None)

    async def kv_restorable(
        self, doc: StoredDocument, token_ids: list[int]
    ) -> tuple[int, str | None]:
        """Tokens of `token_ids` a restore of `doc` would load, or 0 and why not. Checked in
        this process, not the engine core: a store that does not answer stalls no step."""
        if self.kv_store is None:
            return 0, "disabled"
        if self._kv_signature is None:
            self._kv_signature = await self.engine.engine_core.call_utility_async(
                "wim_kv_signature"
            )
        signature, block_size = self._kv_signature["signature"], self._kv_signature["block_size"]
        blocks, reason = await asyncio.to_thread(
            self.kv_store.restorable, doc, signature, block_size, token_ids
        )
        return blocks * block_size, reason

    async def delete_stored(self, doc: StoredDocument) -> bool:
        """Remove `doc`'s stored KV (True: gone or never stored; False: store unreachable)."""
        return self.kv_store is None or await asyncio.to_thread(self.kv_store.delete, doc)

    def load(self) -> AdmissionLoad:
        return self.admission.load()

    async def kv_stats(self) -> KVStats:
        stats = await self.engine.engine_core.call_utility_async("wim_kv_stats")
        return KVStats(
            free_blocks=stats["free_blocks"],
            total_blocks=stats["total_blocks"],
            cached_blocks=stats["cached_blocks"],
            parked_sessions=stats["parked_sessions"],
        )

    async def peak_blocks(self, salt: str) -> int:
        """The most KV blocks the requests of `salt` held at once."""
        return await self.engine.engine_core.call_utility_async("wim_peak_blocks", salt)

    async def purge(self, salt: str) -> dict[str, int]:
        """Purge `salt`'s KV from the prefix cache and close it: its blocks still busy are
        purged when they are freed. Zeroes the blocks if `config.zero_purged_blocks`."""
        return await self.engine.engine_core.call_utility_async(
            "wim_purge_salt", salt, self.config.zero_purged_blocks
        )

    async def salt_blocks(self, salt: str) -> list[int]:
        """The KV blocks `salt`'s live requests hold, and those recorded for its purge."""
        return await self.engine.engine_core.call_utility_async("wim_salt_blocks", salt)

    async def block_magnitudes(self, block_ids: list[int]) -> list[float]:
        """Each block's largest absolute KV value, read in the (first) worker."""
        results = await self.engine.collective_rpc(kv_memory.BLOCK_MAGNITUDES, args=(block_ids,))
        return results[0]

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        exact_tokens: bool = False,
        cache_salt: str | None = None,
    ) -> Completion:
        """One ordinary greedy request outside any WiM context (plain long context, RAG).

        It carries no cache salt, so it may hit prefix blocks of other ordinary requests (the
        shared system prompt); `cost` says how many. A fresh `cache_salt` rules such hits out.
        `exact_tokens` forces `max_tokens` tokens, for timing comparisons at a fixed answer
        length.
        """
        started = time.perf_counter()
        token_ids: list[int] = []
        cost = None
        async for chunk in self.stream_complete(
            prompt_ids,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            exact_tokens=exact_tokens,
            cache_salt=cache_salt,
        ):
            token_ids += chunk.token_ids
            cost = cost or chunk.cost
        assert cost is not None
        return Completion(
            text=self.tokenizer.decode(token_ids).strip(),
            token_ids=token_ids,
            cost=cost,
            seconds=time.perf_counter() - started,
        )

    async def stream_complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        stop: Sequence[str] = (),
        exact_tokens: bool = False,
        cache_salt: str | None = None,
        reserve: bool = False,
    ) -> AsyncIterator[CompletionChunk]:
        """`complete`, streamed as it decodes. `stop` strings end the text (excluded).

        `reserve` holds the request's worst-case KV blocks in admission control while it runs
        (waiting for room like a WiM job): a service request beside parked WiM contexts must
        not take blocks their reservations count on. Leaving early aborts the request.
        """
        from vllm.inputs import tokens_input

        limits = self.limits
        check_window(len(prompt_ids) + max_tokens, limits.max_model_len, "the prompt and answer")
        params = sampling_params(
            max_tokens,
            stop_token_ids=self.tokenizer.eos_token_ids | stop_token_ids,
            stop=stop,
            exact_tokens=exact_tokens,
            detokenize=True,  # the text is the answer: stop strings and held-back characters
        )
        stream = self.engine.generate(  # starts on the first iteration
            tokens_input(prompt_ids, cache_salt=cache_salt),
            params,
            self.next_request_id("plain", "complete"),
            priority=PRIORITY[RequestKind.ANSWER],
        )
        worst_case = plain_request_blocks(len(prompt_ids), max_tokens, limits.block_size)
        blocks = worst_case if reserve else 0
        if blocks:
            await self.admission.acquire(blocks, session=False)
        first = True
        try:
            async for output in stream:
                completion = output.outputs[0]
                yield CompletionChunk(
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    cost=PromptCost(len(prompt_ids), output.num_cached_tokens or 0)
                    if first
                    else None,
                    finish_reason=completion.finish_reason,
                )
                first = False
        finally:
            await stream.aclose()
            if blocks:
                self.admission.release(blocks, session=False)
