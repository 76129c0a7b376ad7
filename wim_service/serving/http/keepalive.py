"""Server-sent events kept alive: a comment frame whenever a stream has sent nothing for a while.

A streamed answer may be silent for long (a document being read before its first margin, a
failover's rebuild), and a client or load balancer cannot tell such a silence from a host cut
off the network, where no byte and no error will ever come. With a frame at least every
`every_s`, a client may give up on a stream silent for a few of them (docs/serving.md) and
retry elsewhere, without a read timeout as long as the longest job. SSE parsers skip a line
that starts with `:` (the `openai` client's `SSEDecoder` among them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")

HEARTBEAT = ": keep-alive\n\n"


async def next_or_none(items: AsyncIterator[T]) -> T | None:
    """The next item; None at the end (a StopAsyncIteration does not cross a task, nor a
    timeout's scope)."""
    try:
        return await anext(items)
    except StopAsyncIteration:
        return None


async def with_heartbeats(frames: AsyncGenerator[str, None], every_s: float) -> AsyncIterator[str]:
    """`frames`, with `HEARTBEAT` sent after every `every_s` without one.

    The next frame is awaited in one task that a beat leaves running, so that no frame is lost
    or reordered by a beat. Closing this stream (the response closed, the client gone) ends the
    frame it waits for and closes `frames`, whose own `finally` releases the job's lease.
    """
    pending: asyncio.Task[str | None] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(next_or_none(frames))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield HEARTBEAT
                continue
            frame = pending.result()
            pending = None
            if frame is None:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            # The generator must have stopped running before it can be closed.
            await asyncio.wait({pending})
        await frames.aclose()
