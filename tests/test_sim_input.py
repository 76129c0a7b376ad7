"""`wim sim` on bad input: traces, profiles and flags out of bounds are refused with one line
naming what is wrong (status 2), never a `nan` table, a traceback or memory without bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from wim_service.sim import traces
from wim_service.sim.traces import TraceError, read_trace

WIM = Path(sys.executable).with_name("wim")


def mooncake_line(timestamp: str = "0", tokens: str = "100") -> str:
    """A Mooncake row as text: its numbers as written, JSON or not."""
    return (
        f'{{"timestamp": {timestamp}, "input_length": {tokens}, "output_length": 20, '
        '"hash_ids": [1]}'
    )


def document_row(**change: Any) -> dict[str, Any]:
    row = {
        "timestamp_s": 0,
        "session_id": "s",
        "document_id": "d",
        "document_tokens": 3000,
        "query_tokens": 10,
        "answer_tokens": 10,
        "wim": True,
    }
    return row | change


def trace_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def refusal(path: Path) -> str:
    """Why the trace in `path` is refused."""
    with pytest.raises(TraceError) as refused:
        read_trace(path)
    return str(refused.value)


# -- the trace's numbers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timestamp", "message"),
    [
        ("NaN", "NaN is not a finite number"),
        ("Infinity", "Infinity is not a finite number"),
        ("-Infinity", "-Infinity is not a finite number"),
        ("1e999", "1e999 is not a finite number"),  # Python's float() makes it infinity
        ("1e308", "timestamp must be a number within 0-1e"),
        ("-5", "timestamp must be a number within 0-1e"),
    ],
)
def test_a_timestamp_must_be_finite_and_bounded(
    tmp_path: Path, timestamp: str, message: str
) -> None:
    path = trace_file(tmp_path, mooncake_line(), mooncake_line(timestamp))
    assert f"t.jsonl:2: {message}" in refusal(path)


def test_a_count_of_hundreds_of_digits_is_refused_before_any_arithmetic(tmp_path: Path) -> None:
    """It overflowed a float division (`OverflowError`) when its work was costed."""
    path = trace_file(tmp_path, mooncake_line(), mooncake_line(tokens="1" + "0" * 363))
    assert "t.jsonl:2: an integer of 364 digits" in refusal(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"document_tokens": 10**14}, "document_tokens must be an integer within 1-1,000,000"),
        ({"query_tokens": 1_000_001}, "query_tokens must be an integer within 1-1,000,000"),
        # One margin per segment of the live service's smallest, 32 tokens: 94 of 3,000.
        ({"margins": 10**12}, "margins must be an integer within 0-94, not 1000000000000"),
        ({"margins": 95}, "margins must be an integer within 0-94"),
    ],
)
def test_token_counts_and_margins_are_bounded(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    """A huge `margins` or `document_tokens` took memory until the process was killed."""
    path = trace_file(tmp_path, json.dumps(document_row(**change)))
    assert f"t.jsonl:1: {message}" in refusal(path)
    # At the bounds the row reads.
    (request,) = read_trace(trace_file(tmp_path, json.dumps(document_row(margins=94)))).requests
    assert request.margins == 94


def test_a_refusal_shows_a_long_value_cut_short(tmp_path: Path) -> None:
    path = trace_file(tmp_path, json.dumps(document_row(document_id="d", wim="x" * 5000)))
    message = refusal(path)
    assert "(5,002 characters)" in message and len(message) < 200


# -- the trace's size ---------------------------------------------------------------------


def test_deeply_nested_json_is_not_json(tmp_path: Path) -> None:
    """It raised `RecursionError` out of the reader."""
    path = trace_file(tmp_path, mooncake_line(), "[" * 100_000 + "]" * 100_000)
    assert "t.jsonl:2: not JSON (nested too deeply)" in refusal(path)


def test_a_line_longer_than_its_bound_is_refused(tmp_path: Path) -> None:
    long = '{"pad": "' + "x" * traces.MAX_LINE_CHARS + '"}'
    path = trace_file(tmp_path, mooncake_line(), long)
    assert "t.jsonl:2: longer than 1,000,000 characters" in refusal(path)


@pytest.mark.parametrize(
    ("bound", "value", "message"),
    [
        ("MAX_TRACE_CHARS", 300, "t.jsonl: larger than 300 characters"),
        ("MAX_REQUESTS", 3, "t.jsonl:4: more than 3 requests"),
        # Each row: one prefix hash.
        ("MAX_TRACE_BLOCKS", 2, "t.jsonl:3: more than 2 prefix hashes and margins in all"),
    ],
)
def test_a_trace_is_bounded_in_characters_rows_and_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: str, value: int, message: str
) -> None:
    path = trace_file(tmp_path, *(mooncake_line(str(t)) for t in range(5)))
    assert len(read_trace(path).requests) == 5
    monkeypatch.setattr(traces, bound, value)
    assert message in refusal(path)


def test_a_wim_rows_margins_count_toward_the_trace_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `margins`, as many as 32-token segments: 94 for 3,000 tokens."""
    monkeypatch.setattr(traces, "MAX_TRACE_BLOCKS", 94 + 5)
    path = trace_file(tmp_path, json.dumps(document_row()), json.dumps(document_row(margins=5)))
    assert len(read_trace(path).requests) == 2
    path = trace_file(tmp_path, json.dumps(document_row()), json.dumps(document_row(margins=6)))
    assert "t.jsonl:2: more than 99 prefix hashes" in refusal(path)
