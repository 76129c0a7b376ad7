"""Streamed answers kept alive (`serving/http/keepalive.py`, `http/responses.py` `started`):
heartbeats fill a stream's silences without losing or reordering a frame, a closed stream
closes what it reads, and a streamed job whose first event is late starts its 200 stream and
reports a failure as an `error` event. Driven by events, not by clocks: a heartbeat interval
of a few milliseconds only decides how soon a beat comes, never what the tests see."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Message

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica, job_events
from wim_service.serving.http.keepalive import HEARTBEAT, with_heartbeats
from wim_service.serving.http.responses import Item, started
from wim_service.serving.ingress import build_http_app
from wim_service.serving.replica.client import ReplicaLost
from wim_service.serving.routing.router import WiMRouter
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import AnswerEvent, ErrorEvent, WiMEvent
from wim_service.wim.options import WiMOptions

BEAT_S = 0.005
# Only a guard against a hang on the code before the fix: no assertion reads a duration.
HANG_S = 60.0


class Frames:
    """An inner stream that sends what the test puts, when it puts it (None ends it)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[str]:
        try:
            while (frame := await self.queue.get()) is not None:
                yield frame
        finally:
            self.closed = True


async def next_frame(stream: AsyncIterator[str]) -> tuple[int, str]:
    """The next frame that is not a heartbeat, and how many heartbeats came before it."""
    beats = 0
    while (frame := await anext(stream)) == HEARTBEAT:
        beats += 1
    return beats, frame


async def test_heartbeats_fill_silences_and_no_frame_is_lost_or_reordered() -> None:
    inner = Frames()
    stream = with_heartbeats(inner.stream(), BEAT_S)
    # Nothing to send yet: only a heartbeat can come, and the frame awaited meanwhile is
    # the one that arrives next (a beat that cancelled it would have ended the inner stream).
    assert await anext(stream) == HEARTBEAT
    assert await anext(stream) == HEARTBEAT
    inner.queue.put_nowait("event: a\n\n")
    assert (await next_frame(stream))[1] == "event: a\n\n"
    for frame in ("event: b\n\n", "event: c\n\n", None):
        inner.queue.put_nowait(frame)
    assert (await next_frame(stream))[1] == "event: b\n\n"
    assert (await next_frame(stream))[1] == "event: c\n\n"
    assert [frame async for frame in stream if frame != HEARTBEAT] == []
    assert inner.closed


async def test_closing_the_stream_closes_what_it_reads() -> None:
    # Closed while the next frame is awaited (after a beat), and closed between two frames.
    waiting, between = Frames(), Frames()
    stream = with_heartbeats(waiting.stream(), BEAT_S)
    assert await anext(stream) == HEARTBEAT
    await stream.aclose()  # type: ignore[attr-defined]
    assert waiting.closed
    stream = with_heartbeats(between.stream(), BEAT_S)
    between.queue.put_nowait("event: a\n\n")
    assert (await next_frame(stream))[1] == "event: a\n\n"
    await stream.aclose()  # type: ignore[attr-defined]
    assert between.closed


async def test_a_first_event_later_than_the_heartbeat_is_not_waited_for() -> None:
    """`started` returns the stream before its job's first event; a failure before that event
    comes as an `error` event with its retry hint, and the job's stream is closed."""
    release, closed = asyncio.Event(), []

    async def refused_late() -> AsyncIterator[Item]:
        try:
            await release.wait()
            raise WiMError(ErrorCode.UNAVAILABLE, "no replica", retry_after_s=5)
            yield  # an async generator
        finally:
            closed.append(True)

    items = await asyncio.wait_for(started(refused_late(), BEAT_S), HANG_S)
    release.set()
    assert [item async for item in items] == [
        ("", ErrorEvent(code="unavailable", message="no replica", retry_after_s=5))
    ]
    assert closed == [True]

    async def answering_late() -> AsyncIterator[Item]:
        await release.wait()
        yield "replica-a", AnswerEvent(text="4417")

    release.clear()
    items = await asyncio.wait_for(started(answering_late(), BEAT_S), HANG_S)
    release.set()
    assert [item async for item in items] == [("replica-a", AnswerEvent(text="4417"))]


class SilentThenLost(FakeReplica):
    """A replica whose one-shot job sends nothing until `go` is set, and is then lost."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.go = asyncio.Event()

    async def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        await self.go.wait()
        self.dead = True
        raise ReplicaLost(self.name, RuntimeError("actor died"))
        yield  # an async generator


class Exchange:
    """One request over raw ASGI messages; `on_body` sees each chunk of the answer as sent."""

    def __init__(self, body: dict[str, Any], on_body: Any) -> None:
        self.body, self.on_body = json.dumps(body).encode(), on_body
        self.status = 0
        self.text = ""
        self.sent = False

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/wim",
            "raw_path": b"/wim",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }

    async def receive(self) -> Message:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer ends
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.text += message.get("body", b"").decode()
            self.on_body(self.text)


async def test_a_streamed_job_silent_past_the_heartbeat_is_answered_200_then_an_error() -> None:
    """The router does not hold a streamed answer's status until its first event: the 200
    stream starts with a heartbeat, and the failure that came later is an `error` event that
    keeps its retry hint (a client that read a heartbeat knows the service is there)."""
    replica = SilentThenLost("a")
    config = {"router": {"replica_wait_s": 0, "stream_heartbeat_s": BEAT_S}}
    router = WiMRouter(None, config, client=FakeClient(replica), http_host="127.0.0.1")
    app = build_http_app(router)

    def on_body(text: str) -> None:
        if HEARTBEAT in text:
            replica.go.set()  # the job fails only once the client has seen the stream alive

    exchange = Exchange({"context": DOCUMENT, "query": "q", "stream": True}, on_body)
    try:
        await asyncio.wait_for(app(exchange.scope(), exchange.receive, exchange.send), HANG_S)
    finally:
        router.shutdown()
    assert exchange.status == 200
    assert exchange.text.startswith(HEARTBEAT)
    frames = [f for f in exchange.text.split("\n\n") if f and f + "\n\n" != HEARTBEAT]
    assert len(frames) == 1 and frames[0].startswith("event: error\ndata: ")
    error = json.loads(frames[0].removeprefix("event: error\ndata: "))
    assert error["code"] == "unavailable" and error["retry_after_s"] == 5


class StuckAfterFirst(FakeClient):
    """Every job sends its first event, then nothing ever again."""

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        yield job_events()[0]
        await asyncio.Event().wait()


async def test_a_streamed_job_past_its_deadline_ends_with_an_error_event() -> None:
    """The job deadline (`request_timeout_s`) holds for a stream whose steps run in tasks of
    their own: the job is stopped and the stream ends with `deadline_exceeded`, instead of
    heartbeats forever (a deadline timed across a yield cancelled a task long finished)."""
    config = {
        "router": {"replica_wait_s": 0, "stream_heartbeat_s": BEAT_S, "request_timeout_s": 0.2}
    }
    router = WiMRouter(
        None, config, client=StuckAfterFirst(FakeReplica("a")), http_host="127.0.0.1"
    )
    app = build_http_app(router)
    exchange = Exchange({"context": DOCUMENT, "query": "q", "stream": True}, lambda _: None)
    try:
        await asyncio.wait_for(app(exchange.scope(), exchange.receive, exchange.send), HANG_S)
    finally:
        router.shutdown()
    frames = [f for f in exchange.text.split("\n\n") if f and f + "\n\n" != HEARTBEAT]
    assert exchange.status == 200 and HEARTBEAT in exchange.text
    assert [f.split("\n")[0] for f in frames] == ["event: segment", "event: error"]
    assert json.loads(frames[1].split("data: ", 1)[1])["code"] == "deadline_exceeded"
