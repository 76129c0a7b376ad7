"""How `wim sim` refuses bad input in one short line (`sim/traces.py`, `sim/settings.py`): what a
Mooncake row's hashes may be, the line an error names, how long a shown value may be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wim_service.sim.settings import check_bounds
from wim_service.sim.traces import Request, Trace, TraceError, read_trace


def _mooncake(tmp_path: Path, **fields: Any) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [0, 2]} | fields,
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("hashes", [{}, [1.5], [True], "01", None])
def test_hash_ids_must_be_a_list_of_integers(tmp_path: Path, hashes: object) -> None:
    with pytest.raises(TraceError, match=r"trace.jsonl:2: hash_ids must be a list of integers"):
        read_trace(_mooncake(tmp_path, hash_ids=hashes))


def test_a_bad_output_length_is_named_by_its_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"trace.jsonl:2: output_length must be an integer"):
        read_trace(_mooncake(tmp_path, output_length=0))


def test_a_value_shown_in_an_error_is_cut_past_40_characters(tmp_path: Path) -> None:
    forty, forty_one = "x" * 38, "x" * 39  # their reprs: 40 and 41 characters
    with pytest.raises(TraceError) as whole:
        read_trace(_mooncake(tmp_path, input_length=forty))
    assert str(whole.value).endswith(f"not {forty!r}")
    with pytest.raises(TraceError) as cut:
        read_trace(_mooncake(tmp_path, input_length=forty_one))
    assert str(cut.value).endswith(f"not {repr(forty_one)[:30]}... (41 characters)")


def test_a_scaled_trace_keeps_its_kind() -> None:
    trace = Trace("document", (Request(index=0, arrival_s=2.0, prompt_tokens=1, answer_tokens=1),))
    scaled = trace.scaled(3.0)
    assert scaled.kind == "document" and scaled.requests[0].arrival_s == 6.0


def test_a_number_shown_in_an_error_is_cut_past_20_characters() -> None:
    # Formatted with thousands separators: 20 characters shown whole, 21 cut to 12.
    with pytest.raises(ValueError) as whole:
        check_bounds([("slots", -500_000_000_000_000, 1, 64)])
    assert str(whole.value) == "slots must be within 1-64, not -500,000,000,000,000"
    with pytest.raises(ValueError) as cut:
        check_bounds([("slots", 10**15, 1, 64)])
    assert str(cut.value) == "slots must be within 1-64, not 1,000,000,00... (21 characters)"
