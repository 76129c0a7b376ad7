"""The real router and HTTP app over scripted fake replicas, served by uvicorn on a free loopback
port in a thread: for the OpenAI-client and browser tests (no Ray, no engine).

The fakes answer from the document they are given: segments are sentence-aligned slices of
its text (real character spans), a margin restates the segment's sentence sharing most words
with the query and is kept, snapped to that sentence (its evidence); of the segments without
one, every third invents a code and is cut short, and the next one is skipped (not written).
The final prompt has room for `NOTE_ROOM` notes, the best first; the answer is the best of
them. Events come with a delay, so that a client can cancel mid-job; each replica counts the
jobs it started, finished and saw cancelled.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.fakes.replicas import FakeClient, FakeReplica
from wim_service.serving.ingress import build_http_app
from wim_service.serving.replica.contracts import DocumentOpened, OpenResult
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import ApiKeys, KeysConfig, TenantConfig, TenantLimits, hash_key
from wim_service.wim.events import (
    AnswerEvent,
    DoneEvent,
    ErrorEvent,
    MarginEvent,
    SegmentEvent,
    Timings,
    Usage,
    WiMEvent,
)
from wim_service.wim.options import WiMOptions

API_KEY = "sk-test-wim"
NO_ANSWER = "The document does not say."
PLAIN_ANSWER = "Hello from a plain request."
# A query with this word fails after its first margin (a late error).
FAILING_WORD = "explode"
NOTE_ROOM = 2
INVENTED = "The code here is 000000."


def segment_spans(text: str, target_chars: int) -> list[tuple[int, int]]:
    """Sentence-aligned (start, end) slices of about `target_chars` that tile `text`."""
    spans, start = [], 0
    for match in re.finditer(r"[.!?]\s+", text):
        if match.end() - start >= target_chars:
            spans.append((start, match.end()))
            start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) > 3}


def scripted_job(text: str, query: str, options: WiMOptions, *, segments: bool) -> list[WiMEvent]:
    """The events of a WiM job over `text` (with `segments`: a one-shot job's segment events)."""
    spans = segment_spans(text, options.segment_tokens * 4)
    asked = _words(query) - {"what", "which", "does", "that", "this", "there"}
    events: list[WiMEvent] = []
    notes = []
    for index, (start, end) in enumerate(spans):
        if segments:
            events.append(
                SegmentEvent(
                    segment=index,
                    segments=len(spans),
                    tokens=(end - start) // 4,
                    context_tokens=end // 4,
                    char_start=start,
                    char_end=end,
                )
            )
        sentences = re.split(r"(?<=[.!?])\s+", text[start:end])
        best = max(sentences, key=lambda s: len(asked & _words(s)))
        note = best.strip() if asked & _words(best) else ""
        if note:
            notes.append((index, note))
            at = text.index(note, start)
            margin = MarginEvent(
                segment=index,
                text=f"This part says: {note}",
                relevant=True,
                grounded=True,
                kept=True,
                evidence=note,
                evidence_start=at,
                evidence_end=at + len(note),
                char_start=start,
                char_end=end,
                elapsed_s=0.01,
            )
        else:
            invents = index % 3 == 2
            margin = MarginEvent(
                segment=index,
                text=INVENTED if invents else "",
                relevant=invents,
                cut_short=invents,
                skipped=index % 3 == 0,
                char_start=start,
                char_end=end,
                elapsed_s=0.01,
            )
        events.append(margin)
        if FAILING_WORD in asked:
            events.append(ErrorEvent(code="engine_error", message="the engine failed"))
            return events
    ranked = sorted(notes, key=lambda n: len(asked & _words(n[1])), reverse=True)
    read, left_out = ranked[:NOTE_ROOM], ranked[NOTE_ROOM:]
    answer = read[0][1] if read else NO_ANSWER
    words = answer.split(" ")
    events += [AnswerEvent(text=w if i == 0 else " " + w) for i, w in enumerate(words)]
    margin_tokens = sum(len(n.split()) for _, n in notes) + len(spans)
    events.append(
        DoneEvent(
            answer=answer,
            notes=sorted(i for i, _ in read),
            notes_dropped=sorted(i for i, _ in left_out),
            usage=Usage(
                context_tokens=len(text) // 4,
                segments=len(spans),
                prompt_tokens_submitted=len(text) // 4 + 50 * len(spans),
                prompt_tokens_cached=40 * len(spans),
                prompt_tokens_computed=len(text) // 4 + 10 * len(spans),
                minimal_prompt_tokens=len(text) // 4,
                margin_tokens=margin_tokens,
                answer_tokens=len(words),
            ),
            timings=Timings(answer_ttft_s=0.2, total_s=0.3),
        )
    )
    return events


def scripted_plain(prompt_ids: list[int], params: PlainParams) -> list[WiMEvent]:
    words = PLAIN_ANSWER.split(" ")[: params.max_tokens]
    text = " ".join(words)
    return [
        *(AnswerEvent(text=w if i == 0 else " " + w) for i, w in enumerate(words)),
        DoneEvent(
            answer=text,
            usage=Usage(
                prompt_tokens_submitted=len(prompt_ids),
                prompt_tokens_cached=0,
                prompt_tokens_computed=len(prompt_ids),
                minimal_prompt_tokens=len(prompt_ids),
                answer_tokens=len(words),
            ),
            timings=Timings(answer_ttft_s=0.01, total_s=0.02),
        ),
    ]


class ScriptedReplica(FakeReplica):
    def __init__(self, name: str, capacity: int = 100_000) -> None:
        super().__init__(name, capacity)
        self.texts: dict[str, str] = {}
        self.started = self.finished = self.cancelled = 0
        self.streams: list[tuple[str, tuple[Any, ...]]] = []  # (method, args) of each job

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        self.documents[document_id] = options
        self.texts[document_id] = document
        spans = segment_spans(document, options.segment_tokens * 4)
        return DocumentOpened(context_tokens=len(document) // 4, segments=len(spans))

    async def close_document(self, document_id: str) -> bool:
        self.texts.pop(document_id, None)
        return await super().close_document(document_id)

    # `ReplicaProtocol`'s jobs, scripted (`ScriptedClient.stream` adds delays and counts).
    async def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        self.streams.append(("run", (document, query, options)))
        for event in scripted_job(document, query, options, segments=True):
            yield event

    async def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        self.streams.append(("complete", (prompt_ids, params)))
        for event in scripted_plain(prompt_ids, params):
            yield event

    async def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        self.streams.append(("query_document", (document_id, query, options)))
        if document_id not in self.texts:
            yield ErrorEvent(code="not_found", message="not on this replica")
            return
        # Segment sizes were fixed when the document was read.
        fixed = self.documents[document_id]
        for event in scripted_job(self.texts[document_id], query, fixed, segments=False):
            yield event


class ScriptedClient(FakeClient):
    """`ReplicaClient` over scripted replicas; `delay_s` between events. While a job streams,
    its replica reports `job_s` more seconds of backlog and one more job running, as a real
    replica books each job's expected cost (`serving/replica/backlog.py`)."""

    def __init__(
        self, *replicas: ScriptedReplica, delay_s: float = 0.0, job_s: float = 5.0
    ) -> None:
        super().__init__(*replicas)
        self.delay_s = delay_s
        self.job_s = job_s

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        target = self.replicas[replica]
        assert isinstance(target, ScriptedReplica)
        target.started += 1
        target.backlog_s += self.job_s
        target.running += 1
        done = False
        try:
            async for event in events:
                await asyncio.sleep(self.delay_s)
                yield event
            done = True
            target.finished += 1
        finally:
            target.backlog_s -= self.job_s
            target.running -= 1
            if not done:
                target.cancelled += 1


def keys(limits: TenantLimits | None = None) -> ApiKeys:
    tenant = TenantConfig(keys=[hash_key(API_KEY)], limits=limits or TenantLimits())
    return ApiKeys(KeysConfig(tenants={"test": tenant}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveService:
    """The app on a real loopback port; `client` and `replica` for what the tests inspect."""

    def __init__(
        self,
        router: dict[str, Any] | None = None,
        *,
        delay_s: float = 0.0,
        limits: TenantLimits | None = None,
    ) -> None:
        self.replica = ScriptedReplica("a")
        self.client = ScriptedClient(self.replica, delay_s=delay_s)
        # Loads polled often: a test that fills the replica sees it soon.
        config = {"router": {"replica_wait_s": 0, "load_poll_interval_s": 0.1, **(router or {})}}
        self.router = WiMRouter(
            None, config, client=self.client, keys=keys(limits), http_host="127.0.0.1"
        )
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                build_http_app(self.router),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
            )
        )

    @contextmanager
    def running(self) -> Iterator[LiveService]:
        # Load the router's tokenizer and sentence splitter now (seconds on a busy machine),
        # not inside the first request a test times.
        # (In a thread of its own: the caller may have a loop running, e.g. playwright's.)
        sizer = self.router.dispatcher.sizer
        warm = sizer.shape("Warm up. Twice.", WiMOptions(), "Why?")
        warming = threading.Thread(target=asyncio.run, args=(warm,))
        warming.start()
        warming.join()
        thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        try:
            yield self
        finally:
            self.server.should_exit = True
            thread.join(30)

    def wait_for(self, predicate: Any, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()
