"""Replay a WiM document trace (`wim sim --generate`'s format, read by
`wim_service.sim.traces`) against a running service, open loop, at the trace's arrival times,
and summarise it as `wim sim` does (`wim_service.sim.report`).

    .venv/bin/python loadtest/replay.py --url http://127.0.0.1:8000 --trace trace.jsonl \\
        --json-out replay.json --policy-label sticky

Each `document_id` is one generated document (`wim_service/eval/tasks.py`'s needle
documents: English filler prose with access codes for three places planted in it) of about
`document_tokens` tokens of the service's own tokenizer; its queries ask for those codes in
turn, the question repeated to about `query_tokens`. A `wim: true` row is a streamed
`POST /wim` on the document's session; the first such row opens the session
(`POST /documents`) and that read counts in its TTFT (a plain row needs no session). A
`wim: false` row is a streamed `POST /v1/chat/completions` with one user turn, the document
and then the query, without `<document>` delimiters: the router finds no document in it and
runs it plain (docs/openai.md). Answers are capped at `answer_tokens` (`answer_max_tokens`,
`max_tokens`).

TTFT is from a row's arrival to its first answer text (the first `answer` event with text;
the first `content` delta), e2e to the end of its stream. With WiM's default `answer_early`
the answer's text is held back until its notes are settled and then comes nearly at once, so
a WiM row's TTFT is close to its e2e. Requests are sent at their arrival whatever is in
flight; after `--max-minutes` the rest are not sent and those in flight are cancelled
(neither counts as completed). Every document session opened is closed at the end, on Ctrl-C
and SIGTERM too. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from loopback import require_loopback

from wim_service.serving.errors import status_of
from wim_service.sim.report import KEYS, figures, table
from wim_service.sim.traces import Request, read_trace

HARD_MAX_MINUTES = 30
REQUEST_TIMEOUT_S = 600  # a WiM request under load waits for a busy engine
CLOSE_TIMEOUT_S = 30
_FACT = re.compile(r"The access code for the (.+?) is (\d+)\.")


# -- documents and queries -----------------------------------------------------------------


def document_id(row: Request) -> str:
    """The trace's name for the row's document: every row of a document trace has one (and
    `parse_args` refuses any other kind of trace)."""
    assert row.document is not None, row
    return row.document


@dataclass(frozen=True)
class Document:
    text: str
    facts: tuple[tuple[str, str], ...]  # (place, access code), in the document's order


class Library:
    """The documents and queries of a trace: deterministic in its document ids and token
    counts, measured in the service's tokenizer (the default model's, unless `model_dir`)."""

    def __init__(self, model_dir: Path | None = None) -> None:
        from wim_service.assets.default_model import default_model_dir
        from wim_service.wim.tokenizer import HFTokenizer

        self.tokenizer = HFTokenizer(model_dir or default_model_dir())
        self._documents: dict[str, Document] = {}

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode_user_text(text).ids)

    def document(self, row: Request) -> Document:
        """The document of `row.document` (made on first use, at the first row's size)."""
        name = document_id(row)
        if name not in self._documents:
            from wim_service.eval.tasks import TaskKind, generate_tasks

            seed = zlib.crc32(name.encode())  # the same text on every run
            task = generate_tasks(
                self.tokenizer,
                kinds=[TaskKind.NEEDLE],
                lengths=[row.document_tokens],
                samples=1,
                seed=seed,
            )[0]
            facts = tuple(_FACT.findall(task.document))
            self._documents[name] = Document(task.document, facts)
        return self._documents[name]

    def query(self, row: Request, asked: int) -> tuple[str, str]:
        """(the query of the `asked`-th row on its document, the code it asks for): the
        document's facts in turn, the question repeated to about `row.query_tokens`.

        Repeated rather than padded with other words: WiM writes a margin only for segments
        that hold most of the query's content words (`skip_unmatched_segments`), so any new
        word would leave the answer without margins."""
        place, code = (facts := self.document(row).facts)[asked % len(facts)]
        question = f"What is the access code for the {place}?"
        repeats = max(1, round(row.query_tokens / self.tokens(question)))
        return " ".join([question] * repeats), code

    def prepare(self, rows: list[Request]) -> None:
        for row in rows:
            self.document(row)


# -- one request ---------------------------------------------------------------------------


class OpenFailed(RuntimeError):
    """`POST /documents` did not open the session: every row waiting for it fails with it."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"POST /documents: {status} {text[:200]}")
        self.status = status


@dataclass
class Record:
    """What one trace row did; `status` is ok, failed, cancelled or not_sent."""

    row: int
    timestamp_s: float
    document_id: str
    wim: bool
    status: str = "not_sent"
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None  # as the service reported them
    cached_tokens: int | None = None
    margin_tokens: int | None = None  # 0 on the plain path
    opened_document: bool = False  # this row's TTFT holds the document's read
    document_tokens_read: int | None = None  # the service's count, when this row read it
    replica: str | None = None
    answer: str = ""
    expected: str = ""  # the access code asked for
    error: str = ""

    def fail(self, why: str) -> None:
        self.status, self.error = "failed", self.error or why

    def fail_in_stream(self, code: str | None, kind: str) -> None:
        """A failure reported inside a 200 stream: a streamed job refused after the stream
        began (its first event later than the service's heartbeat) counts as the status the
        refusal would have had (429), as `wim sim` counts its refusals."""
        self.http_status = status_of(code or "")
        self.fail(f"{kind}: {code}")


async def events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event, data) of a server-sent stream as it arrives; `event` is "message" when the
    frame names none (OpenAI's chunks)."""
    name, data = "message", list[str]()
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        yield name, "\n".join(data)


@dataclass
class Replay:
    """The replay's shared state: the client, the documents and their sessions."""

    client: httpx.AsyncClient
    library: Library
    model: str
    segment_tokens: int
    margin_tokens: int
    origin: float = 0.0  # loop time of the trace's t=0
    scale: float = 1.0
    sessions: dict[str, asyncio.Task[dict[str, Any]]] = field(default_factory=dict)
    opened: dict[str, str] = field(default_factory=dict)  # trace document -> session id
    asked: dict[str, int] = field(default_factory=dict)
    closing: bool = False  # the sessions are being closed

    def arrival(self, row: Request) -> float:
        return self.origin + row.arrival_s * self.scale

    def since(self, arrival: float) -> float:
        return asyncio.get_running_loop().time() - arrival

    async def _open(self, row: Request) -> dict[str, Any]:
        body = {
            "context": self.library.document(row).text,
            "options": {"segment_tokens": self.segment_tokens},
        }
        response = await self.client.post("/documents", json=body)
        if response.status_code != 201:
            raise OpenFailed(response.status_code, response.text)
        opened: dict[str, Any] = response.json()
        self.opened[document_id(row)] = opened["document_id"]
        return opened

    async def session(self, row: Request, record: Record) -> str:
        """The document's session id, opened by the first WiM row (later rows wait for that
        read; after a failed read the next row tries again)."""
        task = self.sessions.get(document_id(row))
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = self.sessions[document_id(row)] = asyncio.create_task(self._open(row))
            record.opened_document = True
        # Shielded: a row cancelled while it waits must not cancel the read other rows share.
        opened = await asyncio.shield(task)
        if record.opened_document:
            record.document_tokens_read = opened["context_tokens"]
        return str(opened["document_id"])

    def query(self, row: Request, record: Record) -> str:
        asked = self.asked.get(document_id(row), 0)
        self.asked[document_id(row)] = asked + 1
        query, record.expected = self.library.query(row, asked)
        return query

    async def wim_row(self, row: Request, record: Record, arrival: float) -> None:
        query = self.query(row, record)
        try:
            session_id = await self.session(row, record)
        except OpenFailed as exc:
            record.http_status = exc.status
            return record.fail(str(exc))
        body = {
            "document_id": session_id,
            "query": query,
            "stream": True,
            "options": {
                "answer_max_tokens": row.answer_tokens,
                "margin_max_tokens": self.margin_tokens,
            },
        }
        async with self.client.stream("POST", "/wim", json=body) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                return record.fail(f"{response.status_code} {(await response.aread())[:200]!r}")
            async for name, data in events(response):
                payload = json.loads(data)
                if name == "answer" and payload["text"]:
                    record.ttft_s = record.ttft_s or self.since(arrival)
                    record.answer += payload["text"]
                elif name == "error":
                    return record.fail_in_stream(payload.get("code"), "error event")
                elif name == "done":
                    usage = payload["usage"]
                    record.prompt_tokens = usage["prompt_tokens_submitted"]
                    record.cached_tokens = usage["prompt_tokens_cached"]
                    record.margin_tokens = usage["margin_tokens"]
                    record.replica = payload.get("replica")
                    record.status = "ok"
        if record.status != "ok":
            record.fail("the stream ended without a done event")

    async def plain_row(self, row: Request, record: Record, arrival: float) -> None:
        text = f"{self.library.document(row).text}\n\n{self.query(row, record)}"
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": row.answer_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                return record.fail(f"{response.status_code} {(await response.aread())[:200]!r}")
            async for _, data in events(response):
                if data == "[DONE]":
                    record.status = "ok" if record.prompt_tokens is not None else "failed"
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return record.fail_in_stream(chunk["error"].get("code"), "error chunk")
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if delta.get("content"):
                    record.ttft_s = record.ttft_s or self.since(arrival)
                    record.answer += delta["content"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                    details = usage.get("completion_tokens_details") or {}
                    record.margin_tokens = details.get("reasoning_tokens") or 0
        if record.status != "ok":
            record.fail("the stream ended without usage and [DONE]")

    async def run_row(self, row: Request, record: Record) -> None:
        arrival = self.arrival(row)
        await asyncio.sleep(max(0.0, arrival - asyncio.get_running_loop().time()))
        record.status = "sending"
        try:
            send = self.wim_row if row.wim else self.plain_row
            await send(row, record, arrival)
        except httpx.HTTPError as exc:
            record.fail(f"transport: {exc!r}")
        except (KeyError, TypeError, ValueError) as exc:  # an answer not shaped as documented
            record.fail(f"unexpected answer: {exc!r}")
        except asyncio.CancelledError:
            record.status = "cancelled"
            raise
        finally:
            record.e2e_s = self.since(arrival)
            if record.status == "ok" and record.ttft_s is None:
                record.fail("no answer text")  # an empty answer has no first token

    async def close_sessions(self) -> list[str]:
        """DELETE every session this replay opened; the ones that would not close."""
        self.closing = True
        for task in self.sessions.values():
            task.cancel()
        await asyncio.gather(*self.sessions.values(), return_exceptions=True)
        left = []
        for session in self.opened.values():
            try:
                response = await self.client.delete(
                    f"/documents/{session}", timeout=CLOSE_TIMEOUT_S
                )
                if response.status_code not in (204, 404):  # 404: expired already
                    left.append(f"{session}: {response.status_code}")
            except httpx.HTTPError as exc:
                left.append(f"{session}: {exc!r}")
        return left


# -- the summary ---------------------------------------------------------------------------

# The replay's own columns, after the simulator's `KEYS`: rows that did not complete, and of
# those the ones refused (429: no room, as `wim sim` counts its refusals).
REPLAY_KEYS = ("failed", "not_sent", "refused")


def summarise_records(
    records: list[dict[str, Any]], policy: str, replicas: int, span_s: float
) -> dict[str, Any]:
    """The replay's summary under the simulator's keys, and `REPLAY_KEYS`.

    A record's `status` is "ok" when completed ("failed", "cancelled" or "not_sent"
    otherwise); latencies and prefix reuse count the completed ones only, a prompt's tokens
    as far as the service reported them. `span_s`: from the trace's start to the last
    request's end."""
    done = [r for r in records if r["status"] == "ok"]
    return {
        "policy": policy,
        "replicas": replicas,
        **figures(
            [r["ttft_s"] for r in done],
            [r["e2e_s"] for r in done],
            prompt_tokens=sum(r.get("prompt_tokens") or 0 for r in done),
            cached_tokens=sum(r.get("cached_tokens") or 0 for r in done),
            span_s=span_s,
        ),
        "failed": sum(r["status"] in ("failed", "cancelled") for r in records),
        "not_sent": sum(r["status"] == "not_sent" for r in records),
        "refused": sum(r.get("http_status") == 429 for r in records),
    }


# -- the whole trace -----------------------------------------------------------------------


@dataclass
class Outcome:
    records: list[Record]
    span_s: float  # from the trace's start to the last request's end
    left_open: list[str]  # sessions that would not close
    interrupted: bool  # by Ctrl-C or SIGTERM


async def run_trace(state: Replay, rows: list[Request], max_s: float) -> Outcome:
    """Send every row at its arrival until `max_s` after the start; then cancel what is in
    flight, and close the sessions opened (also when this task is cancelled)."""
    loop = asyncio.get_running_loop()
    records = [Record(r.index, r.arrival_s, document_id(r), r.wim) for r in rows]
    state.origin = loop.time()
    deadline = state.origin + max_s
    # One task per row, each asleep until its arrival: open loop, whatever the others take.
    tasks = [
        asyncio.create_task(state.run_row(row, record))
        for row, record in zip(rows, records, strict=True)
        if state.arrival(row) <= deadline
    ]
    interrupted = False
    try:
        async with asyncio.timeout_at(deadline):
            await asyncio.wait(tasks)
    except TimeoutError:
        print(f"stopped after {max_s / 60:g} min: the rest is cancelled or not sent", flush=True)
    except asyncio.CancelledError:
        interrupted = True
        print("interrupted: cancelling the requests in flight", flush=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        span_s = loop.time() - state.origin
        left_open = await state.close_sessions()
    return Outcome(records, span_s, left_open, interrupted)


async def service_facts(client: httpx.AsyncClient) -> tuple[str, int]:
    """(the model the service names, its ready engine replicas)."""
    models = await client.get("/v1/models")
    models.raise_for_status()
    ready = await client.get("/readyz")
    return models.json()["data"][0]["id"], len(ready.json().get("replicas", []))


async def replay(args: argparse.Namespace, rows: list[Request], library: Library) -> int:
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=REQUEST_TIMEOUT_S
    ) as client:
        model, replicas = await service_facts(client)
        state = Replay(client, library, model, args.segment_tokens, args.margin_max_tokens)
        state.scale = args.time_scale
        main_task = asyncio.current_task()
        assert main_task is not None
        stopped_by: list[signal.Signals] = []

        def on_stop(signum: signal.Signals) -> None:
            stopped_by.append(signum)
            if not state.closing:  # a second stop must not cut the sessions' closing short
                main_task.cancel()  # the cleanup in run_trace runs

        # Both handled here, not left to asyncio.run: it handles Ctrl-C only when SIGINT has
        # Python's default handler, and a process started in the background by a shell
        # inherits SIGINT ignored.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_stop, signum)
        outcome = await run_trace(state, rows, args.max_minutes * 60)
    records = [vars(record) for record in outcome.records]
    result = summarise_records(records, args.policy_label, replicas, outcome.span_s)
    print(table([result], (*KEYS, *REPLAY_KEYS)))
    for record in outcome.records:
        if record.status in ("failed", "cancelled"):
            print(f"row {record.row}: {record.status} {record.error}")
    for session in outcome.left_open:
        print(f"document session not closed: {session}")
    if args.json_out:
        settings = {
            "url": args.url,
            "trace": str(args.trace),
            "time_scale": args.time_scale,
            "max_minutes": args.max_minutes,
            "segment_tokens": args.segment_tokens,
            "margin_max_tokens": args.margin_max_tokens,
            "started_at": started_at,
            "interrupted": outcome.interrupted,
            "sessions_left_open": outcome.left_open,
        }
        report = {**result, "span_s": outcome.span_s, "settings": settings, "records": records}
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    if outcome.interrupted:
        return 128 + stopped_by[0]
    ok = result["completed"] == len(rows) and not outcome.left_open
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="the service (loopback)")
    parser.add_argument("--key", default=os.environ.get("WIM_LOADTEST_KEY"), help="API key")
    parser.add_argument("--trace", type=Path, required=True, help="JSONL trace")
    parser.add_argument("--json-out", type=Path, help="write the summary and every request here")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply the trace's arrival times by this (0.5: twice as fast; default 1)",
    )
    parser.add_argument("--policy-label", default="live", help="the summary's `policy` name")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=15.0,
        help=f"stop sending after this long, cancel what is in flight (at most {HARD_MAX_MINUTES})",
    )
    parser.add_argument("--segment-tokens", type=int, default=512, help="WiM segment size")
    parser.add_argument(
        "--margin-max-tokens", type=int, default=16, help="tokens per margin (default 16)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.max_minutes <= HARD_MAX_MINUTES:
        parser.error(f"--max-minutes must be in (0, {HARD_MAX_MINUTES}]")
    if args.time_scale <= 0:
        parser.error("--time-scale must be positive")
    try:
        args.url = require_loopback(args.url).rstrip("/")
        trace = read_trace(args.trace)
    except ValueError as exc:  # NotLoopbackError and TraceError are ValueErrors
        parser.error(str(exc))
    if trace.kind != "document":
        parser.error(
            f"{args.trace} is a {trace.kind} trace: a live replay needs a WiM document trace "
            "(its rows name the documents to send)"
        )
    args.rows = list(trace.requests)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    library = Library()
    library.prepare(args.rows)  # before the clock starts: tokenizing is not the service's time
    print(
        f"{len(args.rows)} rows, {len({r.document for r in args.rows})} documents ready in "
        f"{time.monotonic() - began:.1f} s; replaying against {args.url}",
        flush=True,
    )
    try:
        return asyncio.run(replay(args, args.rows, library))
    except KeyboardInterrupt:  # Ctrl-C before the replay's own handler was installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
