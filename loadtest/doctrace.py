"""WiM document traces (JSONL): read, write, and a small default one.

One row a line: `timestamp_s` (arrival, seconds from the trace's start), `session_id`,
`document_id`, `document_tokens`, `query_tokens`, `answer_tokens`, `wim` (bool). Rows with
the same `document_id` query the same document; `wim: true` rows are WiM queries on its
document session, `wim: false` rows plain long-context requests (document text, then query).
`wim sim` reads the same format (and `wim sim --generate` writes it); this module is the
load tools' copy until the two are merged.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "timestamp_s": (int, float),
    "session_id": str,
    "document_id": str,
    "document_tokens": int,
    "query_tokens": int,
    "answer_tokens": int,
    "wim": bool,
}


class TraceError(ValueError):
    """A trace line that is not a row: the message names the file and the line."""


@dataclass(frozen=True)
class TraceRow:
    timestamp_s: float
    session_id: str
    document_id: str
    document_tokens: int
    query_tokens: int
    answer_tokens: int
    wim: bool


def parse_row(data: Any) -> TraceRow:
    """One decoded JSON line as a row; ValueError saying which field is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    missing = [name for name in _FIELDS if name not in data]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    for name, kind in _FIELDS.items():
        value = data[name]
        # bool is an int in Python: a `true` token count is a mistake, not a 1.
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{name} must be {_kind_name(kind)}, got {value!r}")
    row = TraceRow(**{name: data[name] for name in _FIELDS})
    if row.timestamp_s < 0 or min(row.document_tokens, row.query_tokens, row.answer_tokens) < 1:
        raise ValueError("timestamp_s must be >= 0 and token counts >= 1")
    return row


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return (
        "a number"
        if isinstance(kind, tuple)
        else {str: "a string", int: "an integer"}.get(kind, "true or false")
    )


def read_trace(path: Path) -> list[TraceRow]:
    """The rows of a JSONL trace, by arrival (stable: equal times keep the file's order).
    Blank lines are skipped; anything else that is not a row raises TraceError naming the
    line."""
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(parse_row(json.loads(line)))
            except ValueError as exc:  # json.JSONDecodeError is one
                raise TraceError(f"{path}:{number}: not a trace row: {exc}") from None
    if not rows:
        raise TraceError(f"{path}: no trace row")
    return sorted(rows, key=lambda row: row.timestamp_s)


def write_trace(path: Path, rows: list[TraceRow]) -> None:
    path.write_text("".join(json.dumps(asdict(row)) + "\n" for row in rows), encoding="utf-8")


def generate_trace(
    *,
    seconds: float = 180.0,
    documents: int = 3,
    queries_per_document: int = 5,
    document_tokens: tuple[int, int] = (1500, 3000),
    query_tokens: int = 24,
    answer_tokens: int = 16,
    plain_share: float = 0.25,
    seed: int = 0,
) -> list[TraceRow]:
    """A small open-loop trace: `documents` documents, each first asked at a uniform time in
    the first third (so its read overlaps others' queries), then asked again at uniform times
    until `seconds`; a `plain_share` of the rows after each document's first are plain.
    Deterministic in its arguments."""
    rng = random.Random(f"replay-trace/{seed}")
    rows = []
    for index in range(documents):
        document = f"doc-{seed}-{index}"
        tokens = rng.randint(*document_tokens)
        first = rng.uniform(0, seconds / 3)
        times = [
            first,
            *sorted(rng.uniform(first, seconds) for _ in range(queries_per_document - 1)),
        ]
        for number, at in enumerate(times):
            rows.append(
                TraceRow(
                    timestamp_s=round(at, 3),
                    session_id=f"{document}-user",
                    document_id=document,
                    document_tokens=tokens,
                    query_tokens=query_tokens,
                    answer_tokens=answer_tokens,
                    wim=number == 0 or rng.random() >= plain_share,
                )
            )
    return sorted(rows, key=lambda row: row.timestamp_s)
