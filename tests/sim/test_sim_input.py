"""`wim sim` on bad input: traces, profiles and flags out of bounds are refused with one line
naming what is wrong (status 2), never a `nan` table, a traceback or memory without bound."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from wim_service.cli import main
from wim_service.engine.config import EngineConfig
from wim_service.placement.profile import MAX_PROFILE_CHARS, EngineProfile, ProfileError
from wim_service.sim import generate as generator
from wim_service.sim import traces
from wim_service.sim.generate import GeneratorOptions, generate
from wim_service.sim.settings import SimSettings
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


# -- the generator's and the simulator's options ------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"think_s": math.inf}, "think_s must be within 0-86,400, not inf"),
        ({"rate": math.nan}, "rate must be within 0.001-1e+06, not nan"),
        ({"rate": math.inf}, "rate must be within 0.001-1e+06, not inf"),
        ({"wim_fraction": math.nan}, "wim_fraction must be within 0-1, not nan"),
        ({"zipf_exponent": 400.0}, "zipf_exponent must be within 0-10"),
        ({"duration_s": math.inf}, "duration_s must be within 0.001-1e+09"),
        ({"requests": 10**9}, "requests must be within 1-200,000"),
        (
            {"document_tokens": (2000, 10**14)},
            "document_tokens HIGH must be within 2,000-1,000,000",
        ),
        ({"margins": 10**12}, "margins must be within 0-63,"),  # 2,000 tokens: 63 segments
    ],
)
def test_generator_options_are_finite_and_bounded(change: dict[str, Any], message: str) -> None:
    """`think_s=inf` raised ZeroDivisionError; a huge `document_tokens` wrote a trace the
    reader refuses."""
    with pytest.raises(ValueError) as refused:
        generate(replace(GeneratorOptions(requests=10), **change))
    assert str(refused.value) == message or str(refused.value).startswith(message)


def test_a_generated_trace_is_one_the_reader_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each option within bounds, their combination may not be: refused before writing."""
    options = GeneratorOptions(requests=50, wim_fraction=1.0, document_tokens=(3200, 3200))
    assert len(generate(options)) == 50
    monkeypatch.setattr(generator, "MAX_TRACE_BLOCKS", 49 * 100)  # 100 margins a row
    with pytest.raises(ValueError, match="would hold 5,000 prefix hashes and margins"):
        generate(options)
    monkeypatch.setattr(generator, "MAX_ARRIVAL_S", 1.0)
    with pytest.raises(ValueError, match="would last beyond 1 s"):
        generate(replace(options, requests=5))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"segment_tokens": 1}, "segment_tokens must be within 32-65,536, not 1"),
        ({"margin_tokens": 10**6}, "margin_tokens must be within 1-1,024"),
        ({"copy_idle_s": math.nan}, "copy_idle_s must be within 0-1e+09, not nan"),
        ({"slots": 10**12}, "slots must be within 1-65,536"),
        ({"max_copies": 65}, "max_copies must be within 1-64"),
        ({"load_poll_s": 0.0}, "load_poll_s must be within 0.001-1e+09, not 0"),
        ({"retries": -1}, "retries must be within 0-"),
        ({"deadline_s": 0.0005}, "deadline_s must be within 0.001-1e+09, not 0.0005"),
        (
            {"side_by_side_kv_reserve": 1.0},
            "side_by_side_kv_reserve must be at least 0 and below 1",
        ),
        ({"side_by_side_kv_reserve": math.nan}, "side_by_side_kv_reserve must be at least 0 and"),
    ],
)
def test_simulator_settings_are_bounded_as_the_service_is(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        SimSettings(**change).check()
    assert str(refused.value).startswith(message)


def test_simulator_settings_take_subsecond_polls_and_deadlines() -> None:
    SimSettings(load_poll_s=0.5, deadline_s=0.5, retries=0).check()


def test_simulator_settings_take_every_reserve_the_engines_take() -> None:
    # `EngineConfig.side_by_side_kv_reserve`: at least 0, below 1.
    for reserve in (0.0, 0.995):
        EngineConfig(side_by_side_kv_reserve=reserve)
        SimSettings(side_by_side_kv_reserve=reserve).check()


# -- the engine profile -------------------------------------------------------------------


def profile_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(text)
    return path


SHIPPED = json.loads(EngineProfile.load().model_dump_json())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prefill.per_token_s", "Infinity", "prefill.per_token_s: Input should be a finite number"),
        ("decode.fixed_s", "NaN", "decode.fixed_s: Input should be a finite number"),
        ("decode.per_context_token_s", "1e999", "decode.per_context_token_s: Input should be a"),
        ("prefill.fixed_s", "1e300", "prefill.fixed_s: Input should be less than or equal to 600"),
        ("kv_capacity_tokens", "1" + "0" * 363, "kv_capacity_tokens: Input should be less than"),
        ("query_extra_tokens", "10000000", "query_extra_tokens: Input should be less than or"),
    ],
)
def test_a_profile_out_of_bounds_is_one_line_naming_its_file_and_field(
    tmp_path: Path, field: str, value: str, message: str
) -> None:
    """An infinite cost printed `nan` tables; a profile the router loads is refused too."""
    marker = 123456.789
    profile = json.loads(json.dumps(SHIPPED))
    *parents, last = field.split(".")
    target = profile
    for name in parents:
        target = target[name]
    target[last] = marker
    path = profile_file(tmp_path, json.dumps(profile).replace(str(marker), value))
    with pytest.raises(ProfileError) as refused:
        EngineProfile.load(path)
    assert str(refused.value).startswith(f"profile {path}: {message}")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 300


def test_a_profile_larger_than_its_bound_is_not_read_whole(tmp_path: Path) -> None:
    path = profile_file(tmp_path, json.dumps(SHIPPED) + " " * MAX_PROFILE_CHARS)
    with pytest.raises(ProfileError, match="larger than 1,000,000 characters"):
        EngineProfile.load(path)


@pytest.mark.parametrize("name", ["default.json", "one-core.json"])
def test_the_shipped_profiles_are_within_every_bound(name: str) -> None:
    """Both calibrated (`wim calibrate` wrote them), as the router and `wim sim` load
    them."""
    path = resources.files("wim_service.placement").joinpath("profiles", name)
    assert EngineProfile.load(Path(str(path))).block_tokens == 32


def test_a_written_profile_loads_back_and_takes_kv_within_bounds(tmp_path: Path) -> None:
    shipped = EngineProfile.load()
    written = profile_file(tmp_path, shipped.model_dump_json(indent=2))
    assert EngineProfile.load(written) == shipped
    assert shipped.with_kv_capacity(10**9).kv_capacity_tokens == 10**9
    with pytest.raises(ProfileError, match="KV capacity: kv_capacity_tokens: Input should be"):
        shipped.with_kv_capacity(10**9 + 1)


# -- the command --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "{good}", "--time-scale", "inf"], "--time-scale must be within 0.001-10,000"),
        (["--trace", "{good}", "--time-scale", "nan"], "--time-scale must be within"),
        (["--trace", "{good}", "--time-scale", "0"], "--time-scale must be within"),
        (["--trace", "{good}", "--kv-capacity-tokens", "1" + "0" * 30], "KV capacity: kv_"),
        (["--trace", "{good}", "--profile", "{profile}"], "per_token_s: Input should be a finite"),
        (["--trace", "{good}", "--segment-tokens", "1"], "segment_tokens must be within 32-"),
        (["--trace", "{good}", "--copy-idle-s", "inf"], "copy_idle_s must be within"),
        (["--trace", "{nan}"], "nan.jsonl:2: NaN is not a finite number"),
        (["--trace", "{good}", "--replicas", ",".join(["1"] * 65)], "at most 64 counts, not 65"),
        (
            ["--trace", "{good}", "--replicas", "1" * 50],
            "within 1-64, not 111111111111111111111111111111...",
        ),
        (["--generate", "{tmp}/g.jsonl", "--think-s", "inf"], "think_s must be within 0-86,400"),
        (["--generate", "{tmp}/g.jsonl", "--document-tokens", "9-99999999"], "HIGH must be"),
    ],
)
def test_bad_flags_profiles_and_traces_are_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    good = trace_file(tmp_path, mooncake_line())
    nan = tmp_path / "nan.jsonl"
    nan.write_text(good.read_text() + mooncake_line("NaN") + "\n")
    profile = json.loads(json.dumps(SHIPPED))
    profile["prefill"]["per_token_s"] = math.inf
    names = {"tmp": tmp_path, "good": good, "nan": nan}
    names["profile"] = profile_file(tmp_path, json.dumps(profile))
    assert main(["sim", *(arg.format(**names) for arg in argv)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("wim: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""  # no table: it was one of `nan`s


def test_the_command_refuses_a_bad_trace_in_one_line_with_status_2(tmp_path: Path) -> None:
    """`wim sim` as a user runs it: the console script in a subprocess."""
    path = trace_file(tmp_path, mooncake_line(), mooncake_line(tokens="1" + "0" * 363))
    done = subprocess.run(
        [str(WIM), "sim", "--trace", str(path), "--replicas", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"wim: {path}:2: an integer of 364 digits (at most 19)\n"
    assert done.stdout == ""
