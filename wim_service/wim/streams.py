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
    reader = _Reader(tokenizer, stop, give_up, on_text)
    cost: PromptCost | None = None
    try:
        async for chunk in stream:
            if cost is None:
                cost = chunk.cost
            first = not reader.ids
            if first and chunk.token_ids and keep_going and not keep_going(chunk.token_ids[0]):
                reader.ids.extend(chunk.token_ids)
                break
            if reader.read(chunk):
                break
    finally:
        # Leaving early (stop string, NO first token, cancellation) aborts the request.
        await stream.aclose()  # type: ignore[attr-defined]
    return Generated(reader.ids, reader.text, cost)


class _Reader:
    """The text of one generation so far, read a token at a time.

    A reader slower than the engine gets several tokens in one chunk (vLLM merges the deltas
    not yet taken). Where `give_up` may end the generation, each is judged as if it had come
    alone, so that where a generation stops, and so its text, does not depend on the
    reader's timing.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        give_up: Callable[[str], bool] | None,
        on_text: Callable[[str], None] | None,
    ) -> None:
        self.tokenizer, self.stop, self.give_up, self.on_text = tokenizer, stop, give_up, on_text
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []  # every token received, the text's and any after its stop
        self.text = ""
        self.emitted = 0  # how much of `text` went to `on_text`

    def read(self, chunk: GenerationChunk) -> bool:
        """Take `chunk`'s tokens; True once the generation should stop."""
        tokens = chunk.token_ids
        # Where `give_up` is asked decides where the text ends, so then every token is a step
        # of its own. Without it a chunk is one step: the same text, in fewer deltas.
        ends = range(1, len(tokens) + 1) if self.give_up and tokens else [len(tokens)]
        received = len(self.ids)
        for end in ends:
            self.ids[received:] = tokens[:end]
            if self._stops(finished=chunk.finished and end == len(tokens)):
                # The tokens after the stop were generated (and are paid for) all the same.
                self.ids[received:] = tokens
                return True
        return False

    def _stops(self, *, finished: bool) -> bool:
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        self.text = text
        settled = cut >= 0 or finished
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for its next token.
        stable = len(text) if settled else len(text.rstrip("\ufffd"))
        limit = stable if settled else max(stable - self.holdback, self.emitted)
        if self.on_text is not None and limit > self.emitted:
            self.on_text(text[self.emitted : limit])
            self.emitted = limit
        return cut >= 0 or (self.give_up is not None and self.give_up(text[:limit]))


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
