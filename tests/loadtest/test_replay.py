"""loadtest/replay.py: the traces it takes, its summary (fast, no service) and one
small replay on the real stack (`tests/harness/live_stack.py`): every row answered, TTFT before the
end, the document's KV reused by its second WiM query, every session closed."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness.live_stack import (
    API_KEYS,
    BASE,
    MAIN,
    LiveStack,
    metric,
    open_client,
    ready_replicas,
    settled,
    wait_for,
)
from wim_service.sim.report import HEADERS, KEYS
from wim_service.sim.traces import read_trace

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
LIVE_APP = MAIN


def _load(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """A loadtest module (they import their neighbours by their plain names)."""
    monkeypatch.syspath_prepend(str(LOADTEST))
    return importlib.import_module(name)


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load(monkeypatch, "replay")


def row(at: float, document: str, wim: bool, tokens: int = 1100) -> dict:
    return {
        "timestamp_s": at,
        "session_id": f"user-{document}",
        "document_id": document,
        "document_tokens": tokens,
        "query_tokens": 24,
        "answer_tokens": 12,
        "wim": wim,
    }


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the trace and the summary (wim_service.sim's; tests/sim/test_sim.py tests them as such) -------


def test_replay_refuses_a_bad_trace_or_address_before_sending(
    replay: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row(0, "a", True)) + "\n{\n")
    with pytest.raises(SystemExit):
        replay.parse_args(["--url", "http://127.0.0.1:9", "--trace", str(bad)])
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
    good = write_rows(tmp_path / "good.jsonl", [row(0, "a", True)])
    with pytest.raises(SystemExit):
        replay.parse_args(["--url", "http://10.0.0.5:8000", "--trace", str(good)])
    assert "not a loopback address" in capsys.readouterr().err


def test_replay_refuses_a_mooncake_trace(
    replay: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}
    trace = write_rows(tmp_path / "m.jsonl", [line])
    with pytest.raises(SystemExit):
        replay.parse_args(["--url", "http://127.0.0.1:9", "--trace", str(trace)])
    assert "m.jsonl is a mooncake trace: a live replay needs a WiM document trace" in (
        capsys.readouterr().err
    )


def test_replay_reads_the_rows_in_arrival_order(replay: ModuleType, tmp_path: Path) -> None:
    trace = write_rows(tmp_path / "t.jsonl", [row(5, "a", True), row(1.5, "b", False)])
    args = replay.parse_args(["--url", "http://127.0.0.1:9", "--trace", str(trace)])
    assert [(r.arrival_s, replay.document_id(r), r.wim) for r in args.rows] == [
        (1.5, "b", False),
        (5, "a", True),
    ]


def test_the_summary_counts_completed_requests_only(replay: ModuleType) -> None:
    records = [
        {"status": "ok", "ttft_s": 1.0, "e2e_s": 2.0, "prompt_tokens": 100, "cached_tokens": 80},
        {"status": "ok", "ttft_s": 3.0, "e2e_s": 6.0, "prompt_tokens": 300, "cached_tokens": 0},
        {"status": "failed", "ttft_s": None, "e2e_s": 0.5, "http_status": 429},
        {"status": "cancelled", "ttft_s": 9.0, "e2e_s": 9.0},
        {"status": "not_sent", "ttft_s": None, "e2e_s": None},
    ]
    result = replay.summarise_records(records, "sticky", 2, 10.0)
    assert result == {
        "policy": "sticky",
        "replicas": 2,
        "completed": 2,
        "ttft_mean_s": 2.0,
        "ttft_p50_s": 2.0,
        "ttft_p95_s": 2.9,
        "ttft_p99_s": 2.98,
        "e2e_mean_s": 4.0,
        "requests_per_s": 0.2,
        "prefix_reuse": 0.2,
        "goodput_per_s": 0.2,
        "failed": 2,
        "not_sent": 1,
        "refused": 1,
    }
    assert list(result) == [*KEYS, *replay.REPLAY_KEYS]


def test_an_empty_summary_has_no_figures(replay: ModuleType) -> None:
    result = replay.summarise_records([], "expected_wait", 2, 0.0)
    assert result["completed"] == 0 and result["failed"] == result["not_sent"] == 0
    assert result["ttft_p50_s"] is None and result["ttft_p95_s"] is None
    assert result["prefix_reuse"] is None and result["requests_per_s"] is None


def test_the_replay_prints_the_simulator_columns_and_its_own(
    replay: ModuleType, stub: type[Stub], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_rows(tmp_path / "t.jsonl", STUB_TRACE)
    assert replay.main(["--url", stub.url, "--trace", str(trace)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    header, _, line = table
    assert [cell.strip() for cell in header.split("|")[1:-1]] == [
        *(HEADERS[key] for key in KEYS),
        "failed",
        "not_sent",
        "refused",
    ]
    assert [cell.strip() for cell in line.split("|")[1:4]] == ["live", "2", "3"]
    assert [cell.strip() for cell in line.split("|")[-4:-1]] == ["0", "0", "0"]


# -- replay.py against a stub of the API (no engine) ---------------------------------------


class Stub(BaseHTTPRequestHandler):
    """What replay.py calls, answering at once; `/wim` and the chat stream hold their
    answer `pause_s` (a class attribute per server). Records every request in `calls`."""

    protocol_version = "HTTP/1.1"
    pause_s = 0.0
    # The answers' streams end in an `overloaded` error, as a streamed job refused after its
    # stream began does.
    refused_late = False
    calls: list[str]
    url = ""  # the server's base URL, set by the fixture

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, frames: list[str]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for frame in frames:
                data = frame.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(self.pause_s)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a replay cancelled or stopped left mid-stream, as the tests below make it

    def do_GET(self) -> None:
        self.calls.append(f"GET {self.path}")
        if self.path == "/v1/models":
            self._json(200, {"data": [{"id": "stub-model"}]})
        else:
            self._json(200, {"ready": True, "replicas": ["r1", "r2"]})

    def do_DELETE(self) -> None:
        self.calls.append(f"DELETE {self.path}")
        self._json(204)

    def do_POST(self) -> None:
        self.calls.append(f"POST {self.path}")
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/documents":
            return self._json(201, {"document_id": f"doc-{len(self.calls)}", "context_tokens": 900})
        usage = {"prompt_tokens_submitted": 60, "prompt_tokens_cached": 40, "margin_tokens": 8}
        refusal = {"code": "overloaded", "message": "no engine replica had room in time"}
        if self.refused_late and self.path == "/wim":
            return self._stream([f"event: error\ndata: {json.dumps(refusal)}\n\n"])
        if self.refused_late:
            return self._stream([f"data: {json.dumps({'error': refusal})}\n\n"])
        if self.path == "/wim":
            assert body["options"]["answer_max_tokens"] == 12
            done = {"answer": "1234", "usage": usage, "replica": "r1"}
            return self._stream(
                [
                    'event: answer\ndata: {"text": "1234"}\n\n',
                    f"event: done\ndata: {json.dumps(done)}\n\n",
                ]
            )
        assert body["max_tokens"] == 12 and "<document>" not in body["messages"][0]["content"]
        chunk = {"choices": [{"delta": {"content": "1234"}}]}
        last = {
            "choices": [],
            "usage": {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 0}},
        }
        self._stream(
            [f"data: {json.dumps(chunk)}\n\n", f"data: {json.dumps(last)}\n\n", "data: [DONE]\n\n"]
        )


@pytest.fixture
def stub() -> Iterator[type[Stub]]:
    # A subclass per server: its own calls and pause.
    handler: type[Stub] = type("Handler", (Stub,), {"calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


# Small documents: the stub reads nothing, the tokenizer makes them in well under a second.
STUB_TRACE = [row(0, "a", True, 200), row(0.2, "b", False, 200), row(0.4, "a", True, 200)]


def test_a_replay_measures_each_row_and_closes_its_sessions(
    replay: ModuleType, stub: type[Stub], tmp_path: Path
) -> None:
    trace = write_rows(tmp_path / "t.jsonl", STUB_TRACE)
    out = tmp_path / "r.json"
    args = ["--url", stub.url, "--trace", str(trace), "--json-out", str(out)]
    assert replay.main([*args, "--policy-label", "sticky"]) == 0
    report = json.loads(out.read_text())
    assert (report["policy"], report["replicas"], report["completed"]) == ("sticky", 2, 3)
    assert [r["status"] for r in report["records"]] == ["ok"] * 3
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in report["records"])
    opened = [r["opened_document"] for r in report["records"]]
    assert opened == [True, False, False]  # the plain row opens nothing; the 2nd WiM row reuses
    assert report["prefix_reuse"] == round(80 / (60 + 1000 + 60), 4)  # rounded as wim sim does
    assert stub.calls.count("POST /documents") == 1
    assert [c for c in stub.calls if c.startswith("DELETE")] == ["DELETE /documents/doc-3"]


def test_a_refusal_inside_a_stream_counts_as_refused(
    replay: ModuleType, stub: type[Stub], tmp_path: Path
) -> None:
    """A streamed job refused after its stream began (200, then an `overloaded` error event or
    chunk) is counted as the 429 it would have been, WiM and plain rows alike."""
    stub.refused_late = True
    trace = write_rows(tmp_path / "t.jsonl", STUB_TRACE)
    out = tmp_path / "r.json"
    assert replay.main(["--url", stub.url, "--trace", str(trace), "--json-out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert [r["status"] for r in report["records"]] == ["failed"] * 3
    assert [r["http_status"] for r in report["records"]] == [429] * 3
    assert (report["completed"], report["failed"], report["refused"]) == (0, 3, 3)


def test_past_its_time_a_replay_cancels_what_is_in_flight(
    replay: ModuleType, stub: type[Stub], tmp_path: Path
) -> None:
    stub.pause_s = 5  # each answer holds its stream well past the replay's 1.2 s
    rows = [*STUB_TRACE, row(30, "c", True, 200)]
    trace = write_rows(tmp_path / "t.jsonl", rows)
    out = tmp_path / "r.json"
    began = time.monotonic()
    status = replay.main(
        ["--url", stub.url, "--trace", str(trace), "--json-out", str(out), "--max-minutes", "0.02"]
    )
    assert status == 1 and time.monotonic() - began < 15
    report = json.loads(out.read_text())
    assert [r["status"] for r in report["records"]] == ["cancelled"] * 3 + ["not_sent"]
    assert (report["completed"], report["failed"], report["not_sent"]) == (0, 3, 1)
    assert any(c.startswith("DELETE /documents/") for c in stub.calls)


def ignore_sigint() -> None:
    """As a shell starts a background job: SIGINT ignored, and inherited so by its children."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("signum", "status", "started"),
    [
        (signal.SIGTERM, 143, None),
        (signal.SIGINT, 130, None),
        (signal.SIGINT, 130, ignore_sigint),
    ],
)
def test_a_signal_stops_a_replay_and_closes_its_sessions(
    stub: type[Stub],
    tmp_path: Path,
    signum: signal.Signals,
    status: int,
    started: Callable[[], None] | None,
) -> None:
    stub.pause_s = 5
    trace = write_rows(tmp_path / "t.jsonl", STUB_TRACE)
    command = [sys.executable, str(LOADTEST / "replay.py"), "--url", stub.url]
    process = subprocess.Popen(
        [*command, "--trace", str(trace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=started,
    )
    try:
        wait_for(lambda: "POST /wim" in stub.calls, "the first WiM query", timeout=60)
        process.send_signal(signum)  # SIGINT: as a terminal's Ctrl-C
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == status, out
    assert "interrupted" in out
    assert any(c.startswith("DELETE /documents/") for c in stub.calls)


# -- compare_sim.py (no service) -----------------------------------------------------------


@pytest.fixture
def compare_sim(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load(monkeypatch, "compare_sim")


def test_the_serve_config_has_two_fixed_replicas_and_the_policy(
    compare_sim: ModuleType, tmp_path: Path
) -> None:
    import yaml

    path = tmp_path / "serve_config.yaml"
    compare_sim.write_config(path, 8772, 2, {"placement": "expected_wait"}, compare_sim.ENGINE)
    app = yaml.safe_load(path.read_text())["applications"][0]
    assert app["args"]["router"]["placement"] == "expected_wait"
    assert app["args"]["router"]["session_ttl_s"] == 600  # the rest of deploy/'s router args
    # Each engine on a core of its own, as the simulator's replicas are independent.
    assert app["args"]["engine"]["cpu_threads_bind"] == "rank"
    assert app["args"]["engine"]["kv_cache_gib"] == 1.0  # the rest of deploy/'s engine args
    engine = next(d for d in app["deployments"] if d["name"] == "EngineReplica")
    assert engine["num_replicas"] == 2 and "autoscaling_config" not in engine


def test_the_default_trace_is_small_and_simulated_per_policy(
    compare_sim: ModuleType, tmp_path: Path
) -> None:
    import wim_service.placement

    shipped = Path(wim_service.placement.__file__).with_name("profiles") / "default.json"
    argv = ["--out", str(tmp_path), "--skip-live", "--time-scale", "2"]
    args = compare_sim.parse_args([*argv, "--profile", str(shipped)])
    trace = compare_sim.prepare_trace(args)
    assert args.trace == tmp_path / "trace.jsonl"
    assert trace.kind == "document" and len(trace.requests) == 15
    assert len({r.document for r in trace.requests}) == 3
    assert trace.requests[-1].arrival_s <= 180  # within the replay's 3.5 minutes
    row = compare_sim.simulated(args, trace, "expected_wait")
    assert (row["policy"], row["replicas"], row["completed"]) == ("expected_wait", 2, 15)
    assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"]
    report = json.loads((tmp_path / "sim-expected_wait.json").read_text())
    by_row = report.pop("ttft_s_by_row")
    assert report == row and len(by_row) == 15 and all(t > 0 for t in by_row)
    assert sorted(by_row)[7] == pytest.approx(row["ttft_p50_s"], abs=0.01)


def test_compare_sim_without_a_profile_says_how_to_measure_one(
    compare_sim: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--out", str(tmp_path), "--skip-live", "--profile", str(tmp_path / "none.json")]
    assert compare_sim.main(argv) == 2
    assert "none.json; use --calibrate" in capsys.readouterr().err


def test_compare_sim_refuses_a_mooncake_trace(
    compare_sim: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}
    trace = write_rows(tmp_path / "m.jsonl", [line])
    argv = ["--out", str(tmp_path / "out"), "--trace", str(trace), "--skip-live"]
    assert compare_sim.main(argv) == 2
    assert "m.jsonl is a mooncake trace: the replay needs a WiM one" in capsys.readouterr().err


def test_the_comparison_flags_differences_past_the_tolerance(compare_sim: ModuleType) -> None:
    live = {"ttft_p50_s": 10.0, "ttft_p95_s": 20.0, "goodput_per_s": 0.5, "refused": 1}
    sim = {"ttft_p50_s": 12.0, "ttft_p95_s": 16.0, "goodput_per_s": 0.55, "refused": 2}
    close = compare_sim.compare("expected_wait", live, sim)
    far = compare_sim.compare("sticky", live, sim | {"ttft_p50_s": 13.0})
    # Latencies alike, but the simulator answers far more of what the service refused.
    fewer = compare_sim.compare("sticky", live, sim | {"goodput_per_s": 0.7})
    missing = compare_sim.compare("round_robin", live, None)
    assert close["rel_diff_p50_s"] == pytest.approx(0.2) and close["rel_diff_p95_s"] == -0.2
    assert close["rel_diff_goodput"] == pytest.approx(0.1)
    assert compare_sim.within(close, 0.25) == "yes"
    assert compare_sim.within(far, 0.25) == compare_sim.within(fewer, 0.25) == "no"
    assert compare_sim.within(missing, 0.25) == "-"
    close["plain_live_over_sim"] = 0.55
    lines = compare_sim.comparison_table([close, far, missing], 0.25).splitlines()
    assert lines[0].split()[-5:] == ["within", "25%?", "plain", "rows", "live/sim"]
    assert lines[1].split() == [
        *("expected_wait", "10.00", "20.00", "12.00", "16.00", "+20%", "-20%"),
        *("0.50", "0.55", "+10%", "1/2", "yes", "0.55"),
    ]
    assert lines[3].split()[3:] == [*["-"] * 4, "0.50", "-", "-", "1/-", "-", "-"]


def test_the_plain_rows_tell_how_fast_the_engines_ran_against_the_profile(
    compare_sim: ModuleType, tmp_path: Path
) -> None:
    """The median live/simulated first-token time of the plain rows that read their whole
    prompt (WiM rows and plain rows served partly from the cache left out)."""
    rows = [row(t, "alpha-report", wim) for t, wim in ((0, False), (1, True), (2, False))]
    rows += [row(t, "alpha-report", False) for t in (3, 4, 5)]
    trace = read_trace(write_rows(tmp_path / "trace.jsonl", rows))
    timings = ((2.0, 0), (9.0, 0), (2.4, 0), (1.4, 0), (0.1, 2048), (0.1, 2048))
    records = [{"row": i, "ttft_s": t, "cached_tokens": c} for i, (t, c) in enumerate(timings)]
    (tmp_path / "live-expected_wait.json").write_text(json.dumps({"records": records}))
    simulated = {"ttft_s_by_row": [2.0, 1.0, 2.0, 1.0, 1.0, 1.0]}
    (tmp_path / "sim-expected_wait.json").write_text(json.dumps(simulated))
    args = argparse.Namespace(out=tmp_path)
    # Of 1.0, 1.2 and 1.4; with the cached rows' 0.1 and 0.1 it would be 1.0.
    assert compare_sim.plain_speed(args, trace, "expected_wait") == pytest.approx(1.2)
    assert compare_sim.plain_speed(args, trace, "sticky") is None  # not replayed live


def test_compare_sim_refuses_an_unknown_policy(
    compare_sim: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        compare_sim.parse_args(["--out", str(tmp_path), "--policies", "sticky,fastest"])
    assert "unknown policies ['fastest']" in capsys.readouterr().err


# -- the real stack ------------------------------------------------------------------------

# Two documents, both paths, 30 s of arrivals. The plain rows' prompts (document and query in
# one user turn, ~1,150 tokens) are past `plain_prompt_tokens`: plain only because they hold
# no `<document>` block.
LIVE_TRACE = [
    row(0, "alpha-report", True),
    row(3, "beta-report", False),
    row(10, "alpha-report", True),
    row(14, "beta-report", True),
    row(22, "alpha-report", False),
    row(30, "beta-report", True),
]


@pytest.mark.serving
@pytest.mark.timeout(1200)
def test_a_replay_answers_every_row_and_closes_its_sessions(
    live_stack: LiveStack, replay: ModuleType, tmp_path: Path
) -> None:
    live_stack.deploy(MAIN, engines=2)  # as the other tests of MAIN: no engine restarts
    with open_client() as service:
        wait_for(lambda: len(ready_replicas(service)) == 2, "two ready engine replicas")
        wait_for(lambda: settled(service), "no session or reservation left over", timeout=120)
    trace = write_rows(tmp_path / "trace.jsonl", LIVE_TRACE)
    out = tmp_path / "replay.json"
    status = replay.main(
        [
            *("--url", BASE, "--key", API_KEYS["alpha"], "--trace", str(trace)),
            *("--json-out", str(out), "--max-minutes", "10", "--segment-tokens", "256"),
        ]
    )
    report = json.loads(out.read_text())
    records = report["records"]
    problems = [(r["row"], r["status"], r["error"]) for r in records if r["status"] != "ok"]
    assert problems == [] and status == 0
    assert report["completed"] == len(LIVE_TRACE) and report["failed"] == report["not_sent"] == 0
    for record in records:
        assert record["http_status"] == 200
        assert 0 < record["ttft_s"] < record["e2e_s"], record
        assert record["prompt_tokens"] > 0 and record["answer"]
        # WiM rows wrote margins; the plain rows took the plain path (no margin).
        assert (record["margin_tokens"] > 0) == record["wim"], record
    for document in ("alpha-report", "beta-report"):
        wim_rows = [r for r in records if r["document_id"] == document and r["wim"]]
        first, second = wim_rows[:2]
        assert first["opened_document"] and first["document_tokens_read"] > 1000
        assert not second["opened_document"]
        assert second["cached_tokens"] > 0, second  # the pinned document's KV, reused
    assert report["settings"]["sessions_left_open"] == []
    with open_client() as service:
        wait_for(lambda: settled(service), "every session closed", timeout=60)
        assert metric(service, "wim_sessions_active") == 0


def test_compare_sim_warns_of_a_profile_in_another_dtype_than_the_engines(
    compare_sim: ModuleType,
) -> None:
    import wim_service.placement
    from wim_service.engine.config import EngineConfig
    from wim_service.placement.profile import EngineProfile

    profile = EngineProfile.load(
        Path(wim_service.placement.__file__).with_name("profiles") / "one-core.json"
    )
    assert profile.dtype == "bfloat16"
    assert compare_sim.dtype_warning(profile, EngineConfig(dtype="bfloat16")) is None
    warning = compare_sim.dtype_warning(profile, EngineConfig(dtype="float32"))
    assert "measured in bfloat16, the engines run float32 here (dtype: float32)" in warning
    # The live service's engines: `dtype: auto`, what it picks on this CPU.
    live = compare_sim.live_engine()
    assert live.dtype == "auto"
    assert (compare_sim.dtype_warning(profile, live) is None) == (live.cpu_dtype() == "bfloat16")
