"""The Locust load test (loadtest/): loopback only, and it stops by itself.

Locust runs in a subprocess (importing it here would monkey-patch this process with gevent).
The end-to-end run talks to a stub of the service's HTTP API on 127.0.0.1, never to an engine.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
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


class StubService(BaseHTTPRequestHandler):
    """The service's API as the load test uses it, answering at once."""

    requests: list[str] = []  # noqa: RUF012  (shared with the test, one server at a time)

    def _reply(self, status: int, body: dict[str, str] | None = None) -> None:
        self.requests.append(f"{self.command} {self.path}")
        length = int(self.headers.get("content-length", 0))
        sent = json.loads(self.rfile.read(length)) if length else {}
        if self.command == "POST":
            assert "context" in sent or "document_id" in sent
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if self.path == "/documents":
            self._reply(201, {"document_id": "doc-1"})
        else:
            self._reply(200, {"answer": "4417"})

    def do_DELETE(self) -> None:
        self._reply(204)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def stub_url() -> Iterator[str]:
    StubService.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


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
        "3",
        "--spawn-rate",
        "3",
        "--run-time",
        "50s",
        env=cap,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < 30
    return result.stderr


def test_locust_runs_both_user_kinds_and_stops_at_the_request_cap(stub_url: str) -> None:
    cap = 16
    log = run_until_a_cap(stub_url, {"WIM_LOADTEST_MAX_REQUESTS": str(cap)})
    assert f"the {cap} request cap" in log
    kinds = {request.split(" ", 1)[1].split("/")[1] for request in StubService.requests}
    assert kinds == {"wim", "documents"}
    assert any(r.startswith("DELETE /documents/doc-1") for r in StubService.requests)
    # Stopping lets each user end its task (locust.conf's stop-timeout), so that a session is
    # still deleted: at most one more session (1 + 5 queries + 1) per user.
    assert cap <= len(StubService.requests) <= cap + 3 * 7


def test_locust_stops_at_the_time_cap_before_its_run_time(stub_url: str) -> None:
    log = run_until_a_cap(stub_url, {"WIM_LOADTEST_MAX_SECONDS": "2"})
    assert "the 2 s cap" in log
