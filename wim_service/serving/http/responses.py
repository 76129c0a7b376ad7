"""A job's event stream turned into an HTTP answer: one JSON body, or server-sent events.

The first event decides the status: an error before any output is an HTTP error; a failure
after output has started can only be reported in the stream (an `error` event). A streamed
answer whose first event is slow to come does not wait for it: its stream starts with
heartbeats (`http/keepalive.py`), and a failure before its first event is an `error` event too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from wim_service.serving.errors import ServiceError
from wim_service.serving.http.bodies import MarginOut, WiMResponse
from wim_service.serving.http.keepalive import with_heartbeats
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import DoneEvent, ErrorEvent, WiMEvent

# (replica that produced it, event)
Item = tuple[str, WiMEvent]
# Server-sent events pass proxies unbuffered and uncached.
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


async def close(items: AsyncIterator[Item]) -> None:
    """End a job's events now, and with them its bookkeeping (its tenant's job lease), rather
    than whenever the event loop finalizes the abandoned generators."""
    await items.aclose()  # type: ignore[attr-defined]


async def after_done(items: AsyncIterator[Item]) -> None:
    """Read a job's events past its `done` to their end: the replica's call ends as it ran
    rather than cancelled in its clean-up (Serve would log the answered call `CANCELLED`), and
    the job's bookkeeping ends before its answer is sent."""
    async for _ in items:
        pass


async def first_item(items: AsyncIterator[Item]) -> Item:
    """The job's first event; an error before it (or as it) is raised as a ServiceError."""
    try:
        first = await anext(items)
    except WiMError as exc:
        raise ServiceError(exc.code, exc.message, exc.retry_after_s) from exc
    except StopAsyncIteration as exc:
        raise ServiceError(ErrorCode.ENGINE_ERROR, "the job produced no output") from exc
    event = first[1]
    if isinstance(event, ErrorEvent):
        await close(items)
        raise ServiceError(event.code, event.message, event.retry_after_s)
    return first


async def with_late_errors(first: Item, items: AsyncIterator[Item]) -> AsyncIterator[Item]:
    """The whole job again (first event included); a late failure becomes an error event."""
    replica = first[0]
    try:
        yield first  # closed here too, the job's events are closed with it
        async for replica, event in items:
            yield replica, event
    except WiMError as exc:
        yield replica, ErrorEvent.of(exc)
    finally:
        await close(items)  # closing this generator does not close the one it reads


async def started(
    items: AsyncIterator[Item], streamed_after_s: float | None
) -> AsyncIterator[Item]:
    """A started job's events: the first one is produced before this returns, and an error
    before it raised as a `ServiceError` (`first_item`), later ones as `error` events.

    With `streamed_after_s` (a streamed answer), a first event that has not come within it is
    not waited for: the stream starts, its heartbeats tell the client that the service is still
    there, and a failure before the first event is reported as an `error` event as well. Either
    way the first event is awaited once, by one task, and never lost.
    """
    if streamed_after_s is None:
        return with_late_errors(await first_item(items), items)
    first = asyncio.create_task(first_item(items))
    try:
        await asyncio.wait({first}, timeout=streamed_after_s)
    except asyncio.CancelledError:
        first.cancel()  # the request is gone: so is its job
        raise
    if first.done():
        return with_late_errors(first.result(), items)
    return _late_start(first, items)


async def _late_start(first: asyncio.Task[Item], items: AsyncIterator[Item]) -> AsyncIterator[Item]:
    try:
        item = await first
    except ServiceError as exc:
        yield "", ErrorEvent(code=exc.code, message=exc.message, retry_after_s=exc.retry_after)
        return
    rest = with_late_errors(item, items)
    try:
        async for each in rest:
            yield each
    finally:
        await close(rest)


async def json_response(items: AsyncIterator[Item], session_id: str) -> Response:
    margins: dict[int, MarginOut] = {}
    try:
        async for replica, event in items:
            if event.type == "margin":
                margins[event.segment] = MarginOut.model_validate(event, from_attributes=True)
            elif isinstance(event, ErrorEvent):
                raise ServiceError(event.code, event.message, event.retry_after_s)
            elif isinstance(event, DoneEvent):
                body = WiMResponse(
                    answer=event.answer,
                    margins=[margins[k] for k in sorted(margins)],
                    notes=event.notes,
                    notes_dropped=event.notes_dropped,
                    usage=event.usage,
                    timings=event.timings,
                    session_id=session_id,
                    replica=replica,
                )
                await after_done(items)
                return JSONResponse(body.model_dump())
    finally:
        await close(items)  # after an error too: the job's books end now, not when collected
    raise ServiceError(ErrorCode.ENGINE_ERROR, "the job ended without an answer")


def sse_frame(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def _sse(items: AsyncIterator[Item], session_id: str) -> AsyncGenerator[str, None]:
    try:
        async for replica, event in items:
            data = event.model_dump(exclude={"type"})
            if event.type == "done":
                data.update(session_id=session_id, replica=replica)
            yield sse_frame(event.type, data)
    finally:
        await close(items)  # a response closed between two events ends the job now


def sse_response(
    items: AsyncIterator[Item], session_id: str, heartbeat_s: float
) -> StreamingResponse:
    return event_stream(_sse(items, session_id), heartbeat_s)


def event_stream(frames: AsyncGenerator[str, None], heartbeat_s: float) -> StreamingResponse:
    """`frames` as a streamed answer, with a heartbeat after every `heartbeat_s` of silence."""
    return StreamingResponse(
        with_heartbeats(frames, heartbeat_s),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )
