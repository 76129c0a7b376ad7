"""The Locust load test (loadtest/): loopback only, and it stops by itself.

Locust runs in a subprocess (importing it here would monkey-patch this process with gevent).
The end-to-end run talks to a stub of the service's HTTP API on 127.0.0.1, never to an engine.
"""

from __future__ import annotations

import configparser
import csv
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"
LOCUST = [sys.executable, "-m", "locust"]


def _load_guard() -> Any:
    """loadtest/loopback.py (the locustfile's own import of it relies on Locust's sys.path)."""
    spec = importlib.util.spec_from_file_location("loopback", LOADTEST / "loopback.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = _load_guard()
require_loopback = guard.require_loopback
NotLoopbackError = guard.NotLoopbackError


@pytest.mark.parametrize(
    "host",
    [
        "http://127.0.0.1:8000",
        "http://127.8.9.10",
        "https://localhost:8443/",
        "http://[::1]:8000",
    ],
)
def test_loopback_hosts_are_accepted(host: str) -> None:
    assert require_loopback(host) == host


@pytest.mark.parametrize(
    "host",
    [
        None,
        "",
        "127.0.0.1:8000",
        "http://10.0.0.5:8000",
        "http://192.168.1.20",
        "http://0.0.0.0:8000",
        "http://[::ffff:10.0.0.1]:8000",
        "http://example.com",
        "http://localhost.example.com",
        "http://127.0.0.1.example.com",
        "http://127.0.0.1:8000@example.com",
    ],
)
def test_other_hosts_are_refused(host: str | None) -> None:
    with pytest.raises(NotLoopbackError):
        require_loopback(host)


def locust(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOCUST, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_locust_exits_before_any_request_on_a_remote_host() -> None:
    # `.invalid` never resolves, so even a broken guard could not reach a real address.
    result = locust(
        "--config",
        "loadtest/locust.conf",
        "--host",
        "http://wim-loadtest.invalid:8000",
        "--run-time",
        "5s",
    )
    assert result.returncode != 0
    assert "is not loopback" in result.stderr
    assert "Starting Locust" in result.stderr
    assert "Ramping to" not in result.stderr


def test_locust_conf_targets_loopback_and_bounds_the_run() -> None:
    parser = configparser.ConfigParser()
    parser.read_string("[locust]\n" + (LOADTEST / "locust.conf").read_text())
    conf = parser["locust"]
    require_loopback(conf["host"])
    assert conf["headless"] == "true"
    assert conf["run-time"] == "5m"
    assert conf["locustfile"] == "loadtest/locustfile.py"


MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-loadtest-1"
# Two replicas' gauges as the router's /metrics shows them.
METRICS_TEXT = """\
# TYPE wim_sessions_active gauge
wim_sessions_active{replica="r1"} 1.0
wim_sessions_active{replica="r2"} 2.0
# TYPE wim_kv_reserved_blocks gauge
wim_kv_reserved_blocks{replica="r1"} 30.0
wim_kv_reserved_blocks{replica="r2"} 12.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m",replica="r1"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="m",replica="r2"} 0.75
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m",replica="r1"} 1.0
vllm:num_requests_running{engine="0",model_name="m",replica="r2"} 2.0
"""
STREAM_PAUSE_S = 0.4  # between a stream's first margin and its end


class StubService(BaseHTTPRequestHandler):
    """The service's API as the load test uses it: `/wim` streamed (segment, margin, then after
    a pause answer and done), `/documents`, `/v1/models`, `/v1/chat/completions`, `/metrics`.
    Each server gets a subclass with its own `requests` and `keys` (see `serve`)."""

    protocol_version = "HTTP/1.1"  # chunked streams: each event reaches the client at once
    requests: list[str]
    keys: list[str | None]

    def _read(self) -> dict[str, Any]:
        self.requests.append(f"{self.command} {self.path}")
        self.keys.append(self.headers.get("authorization"))
        length = int(self.headers.get("content-length", 0))
        return json.loads(self.rfile.read(length)) if length else {}

    def _send(self, status: int, data: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode())

    def _stream(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event, data in events:
            frame = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
            self.wfile.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")
            if event == "margin":
                time.sleep(STREAM_PAUSE_S)
        self.wfile.write(b"0\r\n\r\n")

    def wim(self, body: dict[str, Any]) -> None:
        margin = {"segment": 0, "text": "The code is 4417.", "relevant": True}
        done = {"answer": "4417", "usage": {}, "timings": {}}
        self._stream([("segment", {"segment": 0}), ("margin", margin), ("done", done)])

    def documents(self) -> None:
        self._json(201, {"document_id": "doc-1"})

    def chat(self, body: dict[str, Any]) -> None:
        message = {"role": "assistant", "content": "4417", "reasoning_content": "[segment 0]"}
        usage = {"prompt_tokens": 1500, "completion_tokens": 40, "total_tokens": 1540}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        self._json(200, {"object": "chat.completion", "choices": [choice], "usage": usage})

    def do_GET(self) -> None:
        self._read()
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/metrics":
            self._send(200, METRICS_TEXT.encode(), "text/plain; version=0.0.4")
        else:
            self._json(404, {"code": "not_found"})

    def do_POST(self) -> None:
        body = self._read()
        if self.path == "/documents" and "context" in body:
            self.documents()
        elif self.path == "/wim" and body.get("stream") is True and "query" in body:
            assert "context" in body or body.get("document_id") == "doc-1"
            self.wim(body)
        elif self.path == "/v1/chat/completions" and self._openai_shaped(body):
            self.chat(body)
        else:
            self._json(400, {"code": "stub_refused", "path": self.path})

    @staticmethod
    def _openai_shaped(body: dict[str, Any]) -> bool:
        """The document in the first user turn, the question in the last (docs/openai.md)."""
        messages = body.get("messages", [])
        roles = [message.get("role") for message in messages]
        return (
            body.get("model") == MODEL
            and roles == ["user", "user"]
            and len(messages[0]["content"]) > 1000
            and messages[1]["content"].endswith("?")
            and isinstance(body.get("max_tokens"), int)
        )

    def do_DELETE(self) -> None:
        self._read()
        self._send(204)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


class FailingStub(StubService):
    """Every way a request fails: a one-shot stream ends with an error event, a session
    query's stream without a done event, every other upload is refused with 429 and every
    chat completion with 503."""

    uploads = 0

    def wim(self, body: dict[str, Any]) -> None:
        margin = {"segment": 0, "text": "", "relevant": False}
        if "context" in body:
            error = {"code": "engine_error", "message": "the engine failed"}
            self._stream([("margin", margin), ("error", error)])
        else:
            self._stream([("margin", margin), ("answer", {"text": "44"})])

    def documents(self) -> None:
        type(self).uploads += 1
        if self.uploads % 2:
            super().documents()
        else:
            self._json(429, {"code": "overloaded"})

    def chat(self, body: dict[str, Any]) -> None:
        self._json(503, {"error": {"message": "no replica", "type": "server_error"}})


class RefusedLateStub(StubService):
    """Every WiM stream refused after it began: a margin, then an `overloaded` error event."""

    def wim(self, body: dict[str, Any]) -> None:
        margin = {"segment": 0, "text": "", "relevant": False}
        self._stream([("margin", margin), ("error", {"code": "overloaded", "message": "full"})])


@contextmanager
def serve(handler: type[StubService]) -> Iterator[tuple[str, type[StubService]]]:
    """A stub server on 127.0.0.1 with a handler class of its own; yields its URL and class."""
    stub = type(handler.__name__, (handler,), {"requests": [], "keys": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", stub
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def stub() -> Iterator[tuple[str, type[StubService]]]:
    with serve(StubService) as served:
        yield served


def run_until_a_cap(stub_url: str, cap: dict[str, str]) -> str:
    """Locust with locust.conf against the stub for up to 50 s; returns its log once the cap
    in `cap` (WIM_LOADTEST_MAX_*) has stopped it, well before that."""
    started = time.monotonic()
    result = locust(
        "--config",
        "loadtest/locust.conf",
        "--host",
        stub_url,
        "--users",
        "4",
        "--spawn-rate",
        "4",
        "--run-time",
        "50s",
        "--wim-rate",
        "2",
        env=cap,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < 30
    return result.stderr


def test_locust_runs_every_user_kind_and_stops_at_the_request_cap(
    stub: tuple[str, type[StubService]],
) -> None:
    url, served = stub
    cap = 16
    log = run_until_a_cap(url, {"WIM_LOADTEST_MAX_REQUESTS": str(cap)})
    assert f"the {cap} request cap" in log
    kinds = {request.split(" ", 1)[1].split("/")[1] for request in served.requests}
    assert kinds == {"wim", "documents", "v1"}
    assert any(r.startswith("DELETE /documents/doc-1") for r in served.requests)
    # Stopping lets each user end its task (locust.conf's stop-timeout) and a session user
    # delete its document: at most an upload, a query and a delete more per user.
    assert cap <= len(served.requests) <= cap + 4 * 3


def test_locust_stops_at_the_time_cap_before_its_run_time(
    stub: tuple[str, type[StubService]],
) -> None:
    log = run_until_a_cap(stub[0], {"WIM_LOADTEST_MAX_SECONDS": "2"})
    assert "the 2 s cap" in log


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--wim-rate", "0"], "argument --wim-rate: 0 is not a rate in (0, 100] per second"),
        (["--wim-rate", "fast"], "argument --wim-rate: 'fast' is not a number"),
        (
            ["--wim-metrics-csv", "/nonexistent-wim/metrics.csv"],
            "the folder of '/nonexistent-wim/metrics.csv' does not exist",
        ),
    ],
)
def test_bad_options_stop_locust_before_it_starts(option: list[str], message: str) -> None:
    result = locust("--config", "loadtest/locust.conf", "--run-time", "5s", *option)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Starting Locust" not in result.stderr


@dataclass
class LocustRun:
    """What one Locust run against a stub left: its CSV files and what the stub saw."""

    stats: dict[tuple[str, str], dict[str, str]]  # (type, name) -> row of _stats.csv
    failures: dict[tuple[str, str], str]  # (method, name) -> the reason
    metrics: list[dict[str, str]]
    requests: list[str]
    keys: list[str | None]


def our_tracebacks(stderr: str) -> list[str]:
    """The tracebacks in a Locust run's stderr, less Locust's own race at shutdown: 2.47
    closes its CSV files in `shutdown()` while the greenlet that rewrites them every second
    may run once more ("I/O operation on closed file" in `stats_writer`), after the run's rows
    were written. Any other traceback (the locustfile's, a stats hook's) counts."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return [
        block
        for block in blocks
        if not ("in stats_writer" in block and "I/O operation on closed file" in block)
    ]


def run_on_stub(
    handler: type[StubService], folder: Path, *options: str, env: dict[str, str] | None = None
) -> LocustRun:
    with serve(handler) as (url, served):
        result = locust(
            *("-f", "loadtest/locustfile.py", "--headless", "--only-summary", "--host", url),
            *("--users", "4", "--spawn-rate", "4", "--csv", str(folder / "locust")),
            *("--stop-timeout", "5"),  # requests under way at the end finish, as in measure.py
            *options,
            env=env,
        )
    assert not our_tracebacks(result.stderr), result.stderr[-3000:]
    stats = read_rows(folder / "locust_stats.csv")
    failures = read_rows(folder / "locust_failures.csv")
    return LocustRun(
        stats={(row["Type"], row["Name"]): row for row in stats},
        failures={(row["Method"], row["Name"]): row["Error"] for row in failures},
        metrics=read_rows(folder / "metrics.csv") if (folder / "metrics.csv").exists() else [],
        requests=served.requests,
        keys=served.keys,
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as rows:
        return list(csv.DictReader(rows))


@pytest.fixture(scope="module")
def paced_run(tmp_path_factory: pytest.TempPathFactory) -> LocustRun:
    """Four users (one one-shot, two session, one OpenAI) at one question per second each for
    5 s, the key from the environment, /metrics sampled."""
    folder = tmp_path_factory.mktemp("paced")
    return run_on_stub(
        StubService,
        folder,
        *("--run-time", "5s", "--wim-rate", "1", "--wim-metrics-csv", str(folder / "metrics.csv")),
        env={"WIM_LOADTEST_KEY": KEY},
    )


def test_constant_throughput_paces_the_questions(paced_run: LocustRun) -> None:
    questions = [r for r in paced_run.requests if r in ("POST /wim", "POST /v1/chat/completions")]
    # 4 users x 1/s x 5 s (less the spawning); unpaced, each would ask about 2.5 a second.
    assert 12 <= len(questions) <= 26, len(questions)


def test_streamed_questions_report_their_time_to_first_margin(paced_run: LocustRun) -> None:
    for name in ("/wim one-shot", "/wim session"):
        whole, first = paced_run.stats["POST", name], paced_run.stats["TTFM", name]
        assert int(first["Request Count"]) == int(whole["Request Count"]) > 0
        assert int(whole["Failure Count"]) == 0
        # The whole request includes the stream's pause after its first margin.
        assert float(whole["50%"]) - float(first["50%"]) >= 1000 * STREAM_PAUSE_S * 0.75
    assert not paced_run.failures


def test_the_openai_user_asks_chat_completions(paced_run: LocustRun) -> None:
    chat = paced_run.stats["POST", "/v1/chat/completions"]
    # Paced at 1/s for 5 s less its spawning: the last user spawned, and a loaded machine
    # stretches spawning (fewer than 4 on 1 December with a mutmut run beside it).
    assert int(chat["Request Count"]) >= 2
    assert int(chat["Failure Count"]) == 0  # the stub refuses a body not shaped as the docs say
    assert ("GET", "/v1/models") in paced_run.stats


def test_every_session_is_deleted(paced_run: LocustRun) -> None:
    uploads = paced_run.requests.count("POST /documents")
    assert uploads >= 2
    # Those open when the run ends too: a session user deletes its document as it stops.
    assert paced_run.requests.count("DELETE /documents/doc-1") == uploads


def test_the_csv_counts_the_requests_finished_after_the_run_time(paced_run: LocustRun) -> None:
    counted = {
        (method, name): int(row["Request Count"]) for (method, name), row in paced_run.stats.items()
    }
    assert counted["POST", "/wim one-shot"] + counted["POST", "/wim session"] == (
        paced_run.requests.count("POST /wim")
    )
    assert counted["DELETE", "/documents/[id]"] == paced_run.requests.count(
        "DELETE /documents/doc-1"
    )


def test_the_metrics_sampler_writes_rows_beside_the_run(paced_run: LocustRun) -> None:
    assert len(paced_run.metrics) >= 2  # one at the start, every 5 s, one at the end
    row = paced_run.metrics[-1]
    assert float(row["replicas"]) == 2
    assert float(row["wim_sessions_active"]) == 3
    assert float(row["wim_kv_reserved_blocks"]) == 42
    assert float(row["vllm_kv_cache_usage_perc"]) == 0.5
    assert float(row["vllm_num_requests_running"]) == 3
    assert "GET /metrics" in paced_run.requests
    assert not any("/metrics" in name for _, name in paced_run.stats)  # not a load request


def test_the_key_from_the_environment_is_sent_with_every_request(paced_run: LocustRun) -> None:
    assert paced_run.keys and set(paced_run.keys) == {f"Bearer {KEY}"}


def test_failures_are_named_by_their_reason(tmp_path: Path) -> None:
    run = run_on_stub(
        FailingStub, tmp_path, "--run-time", "4s", "--wim-rate", "2", "--wim-key", "sk-option"
    )
    assert run.failures == {
        ("POST", "/wim one-shot"): "CatchResponseError('error event: engine_error')",
        ("POST", "/wim session"): "CatchResponseError('stream ended without a done event')",
        ("POST", "/documents"): "CatchResponseError('429 overloaded')",
        ("POST", "/v1/chat/completions"): "CatchResponseError('503 unavailable')",
    }
    assert set(run.keys) == {"Bearer sk-option"}
    assert not run.metrics  # no sampler without --wim-metrics-csv
    assert "GET /metrics" not in run.requests


def test_a_refusal_inside_a_stream_is_named_as_the_designed_refusal(tmp_path: Path) -> None:
    run = run_on_stub(RefusedLateStub, tmp_path, "--run-time", "3s", "--wim-rate", "2")
    assert run.failures == {
        ("POST", "/wim one-shot"): "CatchResponseError('429 overloaded')",
        ("POST", "/wim session"): "CatchResponseError('429 overloaded')",
    }


# -- measure.py (no service: its summary from fixture CSVs, its options) ---------------------
