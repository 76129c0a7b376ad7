"""Draining engine streams: one generation's text and cost, and the tasks that run them.

`consume` turns a stream of `GenerationChunk`s into text (stop strings, held-back deltas,
early exits); the rest keeps what a cut-off request cost and stops tasks so that their
engine requests are aborted before the KV they hold is given back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from wim_service.wim.backend import GenerationChunk, PromptCost
from wim_service.wim.tokenizer import Tokenizer


@dataclass
class Generated:
    """A drained generation: its tokens, its text up to the first stop string, its cost."""

    token_ids: list[int]
    text: str
    cost: PromptCost | None


async def consume(
    stream: AsyncIterator[GenerationChunk],
    tokenizer: Tokenizer,
    *,
    stop: list[str],
    keep_going: Callable[[int], bool] | None = None,
    give_up: Callable[[str], bool] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Generated:
    """Drain a generation: decode incrementally, honour stop strings, stream text deltas.

    `keep_going(first_token)` may end the generation right after its first token;
    `give_up(text)` ends it once the text settled so far makes the rest pointless. Text that
    could still turn out to begin a stop string is held back from `on_text` (and from
    `give_up`) until resolved.
    """
    ids: list[int] = []
    text, emitted = "", 0
    cost: PromptCost | None = None
    holdback = max((len(s) for s in stop), default=1) - 1
    try:
        async for chunk in stream:
            if cost is None:
                cost = chunk.cost
            first = not ids
            ids.extend(chunk.token_ids)
            if first and ids and keep_going is not None and not keep_going(ids[0]):
                break
            text = tokenizer.decode(ids)
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
            # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for its next token.
            stable = len(text) if cut >= 0 or chunk.finished else len(text.rstrip("\ufffd"))
            limit = stable if cut >= 0 or chunk.finished else max(stable - holdback, emitted)
            if on_text is not None and limit > emitted:
                on_text(text[emitted:limit])
                emitted = limit
            if cut >= 0 or (give_up is not None and give_up(text[:limit])):
                break
    finally:
        # Leaving early (stop string, NO first token, cancellation) aborts the request.
        await stream.aclose()  # type: ignore[attr-defined]
    return Generated(ids, text, cost)


async def stop_tasks(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended: a task closes its engine request on its
    way out, and that request must be aborted before the job's KV reservation goes back."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)


async def recorded(
    stream: AsyncIterator[GenerationChunk], chunks: list[GenerationChunk]
) -> AsyncIterator[GenerationChunk]:
    """`stream`, keeping every chunk in `chunks`: what a request cost even if it is cut off."""
    try:
        async for chunk in stream:
            chunks.append(chunk)
            yield chunk
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


class HeldText:
    """Answer text held back until the answer is known to stand, then passed on as it comes."""

    def __init__(self) -> None:
        self._held: list[str] = []
        self._sink: Callable[[str], None] | None = None

    def __call__(self, delta: str) -> None:
        if self._sink is None:
            self._held.append(delta)
        else:
            self._sink(delta)

    def release(self, sink: Callable[[str], None]) -> None:
        self._sink = sink
        for delta in self._held:
            sink(delta)
        self._held.clear()
