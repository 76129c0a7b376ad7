"""Request traces: one record for every kind of trace, and the readers that fill it.

Two kinds are read, told apart by their fields:

* Mooncake's public traces (kvcache-ai/Mooncake, FAST25-release/traces/*.jsonl): per line a
  `timestamp` in milliseconds, `input_length`, `output_length` and `hash_ids`, the remapped
  hashes of the prompt's 512-token blocks (a prompt's leading hashes shared with an earlier
  prompt are KV a prefix cache can reuse).
* WiM document traces (`wim sim --generate` writes them): per line `timestamp_s`,
  `session_id`, `document_id`, `document_tokens`, `query_tokens`, `answer_tokens` and `wim`,
  and optionally `margins`. Rows of one `document_id` query one document session; `wim: true`
  rows are WiM queries on it, `wim: false` rows plain long-context requests (the document,
  then the query). A WiM row's `margins` is how many of its document's segments get a margin
  written (WiM's `margin_skip` writes none for a segment that shares no words with the query);
  without it, every segment does.

A row of either kind may say how its client meets a refusal: `retries`, how many times it sends
the request again after a `429`, each time after the `Retry-After` (`wim sim --retries` for the
rows without; none by default).

A `.gz` file is read transparently. A malformed line is a `TraceError` naming its line.

Bounds, so that no trace makes the simulator overflow or take unbounded memory (each is a
`TraceError` naming its line): numbers are finite JSON numbers (no `NaN` or `Infinity`),
integers of at most 19 digits; a timestamp is within 0 to `MAX_ARRIVAL_S` seconds (a Mooncake
`timestamp` in milliseconds); every token count within 1 to `MAX_TOKENS`; a WiM row's
`margins` at most one per `MIN_SEGMENT_TOKENS` of its document (the live service's smallest
segment); a line at most `MAX_LINE_CHARS` characters and nested at most as deep as Python's
`json` parses; a file at most `MAX_TRACE_CHARS` characters (decompressed) and
`MAX_REQUESTS` rows, whose prefix hashes and margins (a WiM row without `margins`: one per
`MIN_SEGMENT_TOKENS`) are at most `MAX_TRACE_BLOCKS` in all.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal

# Mooncake hashes 512-token blocks. A document trace's plain requests share their document's
# KV as the engine caches it: in its KV blocks (vLLM's 32 tokens on CPU, the shipped profile's
# `block_tokens`, the blocks the live router hashes prompts in), so that the reuse simulated is
# the reuse served (whole 512-token blocks would recompute up to 511 tokens of each document).
MOONCAKE_BLOCK_TOKENS = 512
DOCUMENT_BLOCK_TOKENS = 32
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
DOCUMENT_FIELDS = (
    "timestamp_s",
    "session_id",
    "document_id",
    "document_tokens",
    "query_tokens",
    "answer_tokens",
    "wim",
)
TraceKind = Literal["mooncake", "document"]

# Bounds (the module's docstring): each far above any trace replayed here (Mooncake's released
# traces included), each low enough that arithmetic stays finite and that a trace's memory is
# bounded whatever its file holds (docs/routing.md, "Traces", has what it comes to).
MAX_TOKENS = 1_000_000  # any token count of a row: beyond every context window served here
MAX_ARRIVAL_S = 1e9  # about 31 years
MAX_INT_DIGITS = 19  # a 64-bit integer: Mooncake's hash ids are remapped small integers
MAX_LINE_CHARS = 1_000_000
MAX_TRACE_CHARS = 256 * 2**20
MAX_REQUESTS = 200_000
# Prefix hashes (each held by the request and by a replica's prefix cache) and margins (each a
# sequence in a simulated batch) over the whole trace: what a row of a few bytes expands to.
MAX_TRACE_BLOCKS = 10_000_000
MIN_SEGMENT_TOKENS = 32  # the live service's smallest segment (`WiMOptions.segment_tokens`)
MAX_RETRIES = 100  # a row's `retries`: each one is an event of the replay


class TraceError(ValueError):
    """A trace that cannot be replayed: missing, empty, of no known kind, or malformed."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace, whatever its kind.

    A WiM query (`wim`) runs on a copy of its `document` (`document_tokens` of KV under the
    session's own salt) and prefills only its `query_tokens`; any other request prefills its
    `prompt_tokens`, of which the leading `prefix` blocks (hashes of the trace's
    `block_tokens`-token blocks) may be in a replica's prefix cache. A plain row of a
    document trace names its `document` too (a live replay sends its text), but only a WiM
    query is placed by it.
    """

    index: int  # position in the trace, in timestamp order
    arrival_s: float
    prompt_tokens: int  # everything the request prefills when nothing is cached
    answer_tokens: int
    prefix: tuple[int, ...] = ()
    document: str | None = None  # the document of a document trace's row
    document_tokens: int = 0
    query_tokens: int = 0
    wim: bool = False
    session: str | None = None
    margins: int | None = None  # a WiM query's margins written; None: one per segment
    retries: int | None = None  # sent again this often after a 429; None: the replay's default


@dataclass(frozen=True)
class Trace:
    kind: TraceKind
    requests: tuple[Request, ...]

    @property
    def block_tokens(self) -> int:
        """Tokens per hash of its requests' `prefix`."""
        return MOONCAKE_BLOCK_TOKENS if self.kind == "mooncake" else DOCUMENT_BLOCK_TOKENS

    def scaled(self, time_scale: float) -> Trace:
        """The same requests with every arrival time multiplied by `time_scale` (above 1 a
        lighter load: a trace recorded on a big fleet stretched to suit a small one)."""
        return Trace(
            self.kind,
            tuple(replace(r, arrival_s=r.arrival_s * time_scale) for r in self.requests),
        )


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _lines(stream: IO[str], path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line), each line and the whole file within their bounds: a line is read
    at most `MAX_LINE_CHARS` at a time, never whole whatever its length."""
    total = 0
    for number in itertools.count(1):
        line = stream.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            raise TraceError(f"{path}:{number}: longer than {MAX_LINE_CHARS:,} characters")
        total += len(line)
        if total > MAX_TRACE_CHARS:
            raise TraceError(f"{path}: larger than {MAX_TRACE_CHARS:,} characters")
        yield number, line


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError(f"{_short(text)} is not a finite number")
    return value


def _integer(text: str) -> int:
    # Checked before int(): a number of thousands of digits costs time, then overflows floats.
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits:,} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse(line: str) -> Any:
    """The line's JSON value, its numbers finite and bounded; ValueError says why not."""
    try:
        return json.loads(
            line, parse_constant=_refuse_constant, parse_float=_finite, parse_int=_integer
        )
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line."""
    try:
        with _open(path) as stream:
            for number, line in _lines(stream, path):
                if not line.strip():
                    continue
                try:
                    row = _parse(line)
                except ValueError as exc:
                    raise TraceError(f"{path}:{number}: {exc}") from None
                if not isinstance(row, dict):
                    raise TraceError(f"{path}:{number}: not a JSON object")
                yield number, row
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None


def _short(text: str) -> str:
    """`text` cut short: an error is one short line however long the input."""
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


def _shown(value: object) -> str:
    return _short(repr(value))


def _count(
    row: dict[str, Any], field: str, where: str, *, least: int = 1, most: int = MAX_TOKENS
) -> int:
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise TraceError(
            f"{where}: {field} must be an integer within {least}-{most:,}, not {_shown(value)}"
        )
    return value


def _seconds(row: dict[str, Any], field: str, where: str, *, per_second: int = 1) -> float:
    """A timestamp in seconds (`per_second`: its unit's count in one second)."""
    value = row.get(field)
    most = MAX_ARRIVAL_S * per_second
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most:
        shown = _shown(value)
        raise TraceError(f"{where}: {field} must be a number within 0-{most:g}, not {shown}")
    return value / per_second


def detect_kind(row: dict[str, Any]) -> TraceKind:
    if all(field in row for field in MOONCAKE_FIELDS):
        return "mooncake"
    if all(field in row for field in DOCUMENT_FIELDS):
        return "document"
    raise TraceError(
        "unknown trace kind: a line needs the fields of a Mooncake trace "
        f"({', '.join(MOONCAKE_FIELDS)}) or of a WiM document trace ({', '.join(DOCUMENT_FIELDS)})"
    )


def mooncake_request(row: dict[str, Any], where: str) -> Request:
    hashes = row.get("hash_ids")
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    return Request(
        index=0,
        arrival_s=_seconds(row, "timestamp", where, per_second=1000),
        prompt_tokens=_count(row, "input_length", where),
        answer_tokens=_count(row, "output_length", where),
        prefix=tuple(hashes),
    )


class DocumentHashes:
    """Prefix hashes for the documents of a document trace: a plain request's prompt starts
    with its document, so its shared prefix is the document's whole `DOCUMENT_BLOCK_TOKENS`
    blocks (the block holding the document's end and the query's start differs from query to
    query)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def prefix(self, document: str, tokens: int) -> tuple[int, ...]:
        # Numbered by first appearance, not Python's hash(): str hashes change per process.
        base = self._ids.setdefault(document, len(self._ids)) << 32
        return tuple(base + block for block in range(tokens // DOCUMENT_BLOCK_TOKENS))


def document_request(row: dict[str, Any], where: str, hashes: DocumentHashes) -> Request:
    document, session, wim = row.get("document_id"), row.get("session_id"), row.get("wim")
    if not isinstance(document, str) or not document:
        raise TraceError(f"{where}: document_id must be a non-empty string")
    if not isinstance(wim, bool):
        raise TraceError(f"{where}: wim must be true or false, not {_shown(wim)}")
    document_tokens = _count(row, "document_tokens", where)
    query_tokens = _count(row, "query_tokens", where)
    margins = None
    if wim and "margins" in row:
        most = margins_bound(document_tokens, None)
        margins = _count(row, "margins", where, least=0, most=most)
    return Request(
        index=0,
        arrival_s=_seconds(row, "timestamp_s", where),
        prompt_tokens=document_tokens + query_tokens,
        answer_tokens=_count(row, "answer_tokens", where),
        prefix=() if wim else hashes.prefix(document, document_tokens),
        document=document,
        document_tokens=document_tokens,
        query_tokens=query_tokens,
        wim=wim,
        session=str(session),
        margins=margins,
    )


def margins_bound(document_tokens: int, margins: int | None) -> int:
    """The most margins a WiM row may have written: its `margins`, else one per segment of
    the smallest size."""
    return math.ceil(document_tokens / MIN_SEGMENT_TOKENS) if margins is None else margins


def request_blocks(request: Request) -> int:
    """What `request` counts toward `MAX_TRACE_BLOCKS`: its prefix hashes, its margins."""
    margins = margins_bound(request.document_tokens, request.margins) if request.wim else 0
    return len(request.prefix) + margins


def read_trace(path: Path) -> Trace:
    """Every request of the trace in `path`, in timestamp order (ties in file order)."""
    if not path.is_file():
        raise TraceError(f"no trace file {path}")
    kind: TraceKind | None = None
    hashes = DocumentHashes()
    requests: list[Request] = []
    blocks = 0
    for number, row in _rows(path):
        where = f"{path}:{number}"
        if kind is None:
            try:
                kind = detect_kind(row)
            except TraceError as exc:
                raise TraceError(f"{where}: {exc}") from None
        if len(requests) == MAX_REQUESTS:
            raise TraceError(f"{where}: more than {MAX_REQUESTS:,} requests")
        if kind == "mooncake":
            request = mooncake_request(row, where)
        else:
            request = document_request(row, where, hashes)
        if "retries" in row:
            retries = _count(row, "retries", where, least=0, most=MAX_RETRIES)
            request = replace(request, retries=retries)
        requests.append(request)
        blocks += request_blocks(request)
        if blocks > MAX_TRACE_BLOCKS:
            raise TraceError(
                f"{where}: more than {MAX_TRACE_BLOCKS:,} prefix hashes and margins in all"
            )
    if kind is None:
        raise TraceError(f"trace {path} has no requests")
    # A stable sort: requests at one timestamp keep the trace's order.
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return Trace(kind, tuple(replace(r, index=i) for i, r in enumerate(ordered)))
