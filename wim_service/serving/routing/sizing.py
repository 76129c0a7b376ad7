"""How much KV a job needs, computed by the router before it places the job.

The router plans the document exactly as the engine replica will (same tokenizer, same
segmentation) and asks the capacity model (`wim.capacity`) for the worst case. Tokenizing a
long document is CPU work: it runs in a worker thread, off the ingress's event loop.
"""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

from wim_service.engine.config import EngineConfig
from wim_service.serving.errors import ServiceError
from wim_service.wim.backend import EngineLimits
from wim_service.wim.capacity import JobShape
from wim_service.wim.errors import WiMError
from wim_service.wim.options import WiMOptions
from wim_service.wim.plan import prepare_job
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.tokenizer import HFTokenizer


class JobSizer:
    """Worst-case KV blocks of jobs and document sessions, with the engines' tokenizer."""

    def __init__(self, engine: EngineConfig) -> None:
        self.engine = engine
        self.limits = EngineLimits(engine.max_model_len, engine.block_size, True)

    @property
    def tokenizer(self) -> HFTokenizer:
        from wim_service.assets.default_model import default_model_dir

        return _tokenizer(Path(self.engine.model or default_model_dir()))

    def warm_up(self) -> None:
        """Load what the first job would (the tokenizer, the sentence splitter): seconds of
        CPU, which the first request after a start would otherwise wait for."""
        self._shape("A first sentence. A second one.", WiMOptions(), "What is said?")

    def _shape(self, text: str, options: WiMOptions, query: str | None) -> JobShape:
        builder = PromptBuilder(self.tokenizer, options.prompts)
        return prepare_job(builder, text, options, self.limits, query)[1]

    async def shape(self, text: str, options: WiMOptions, query: str | None) -> JobShape:
        """The shape of a one-shot job (`query` given) or a document session (`query=None`)."""
        try:
            return await asyncio.to_thread(self._shape, text, options, query)
        except WiMError as exc:
            raise ServiceError(exc.code, exc.message, exc.retry_after_s) from exc

    def blocks(self, shape: JobShape, *, one_shot: bool) -> int:
        """KV blocks of a one-shot job's or a document session's shape."""
        block, window = self.limits.block_size, self.limits.max_model_len
        if one_shot:
            return shape.one_shot_blocks(block, window)
        return shape.session_blocks(block, window)


@cache
def _tokenizer(model_dir: Path) -> HFTokenizer:
    """One tokenizer per model in a process, however many sizers (routers) it holds."""
    return HFTokenizer(model_dir)
