"""Serve's access lines of the calls the service makes on its own stay out of the replica log;
requests and errors stay in (`serving/observability/logs.py`). The lines are formatted by
Serve's own `access_log_msg`, as a replica writes them; the real stack's idle log is tested in
tests/cli/test_signals.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from ray.serve._private.logging_utils import access_log_msg

from wim_service.serving.observability import logs
from wim_service.serving.replica.protocol import ReplicaProtocol


def _access_line(method: str, route: str, status: str, client: str = "") -> logging.LogRecord:
    message = access_log_msg(
        method=method, route=route, status=status, latency_ms=1.5, client=client
    )
    return logging.makeLogRecord({"msg": message, "serve_access_log": True})


@pytest.mark.parametrize(
    ("method", "route", "status"),
    [
        ("CALL", "load", "OK"),
        ("CALL", "claim", "OK"),
        ("CALL", "metrics_text", "OK"),
        ("CALL", "load", "CANCELLED"),
        ("GET", "/metrics", "200"),
        ("GET", "/readyz", "200"),
        ("GET", "/healthz", "200"),
        ("GET", "/readyz", "CANCELLED"),
    ],
)
def test_a_routine_internal_call_is_left_out(method: str, route: str, status: str) -> None:
    assert logs.routine_access_line(_access_line(method, route, status))
    assert logs.routine_access_line(_access_line(method, route, status, client="10.0.0.1:5"))


@pytest.mark.parametrize(
    ("method", "route", "status"),
    [
        # Requests, whatever their status.
        ("POST", "/wim", "200"),
        ("POST", "/documents", "201"),
        ("POST", "/v1/chat/completions", "200"),
        ("GET", "/", "200"),
        ("CALL", "run", "OK"),
        ("CALL", "open_document", "OK"),
        # Internal calls that failed.
        ("CALL", "load", "ERROR"),
        ("CALL", "claim", "ERROR"),
        ("GET", "/metrics", "500"),
        ("GET", "/readyz", "503"),
        # An HTTP route named like a replica method, and the reverse.
        ("GET", "load", "200"),
        ("CALL", "/metrics", "OK"),
    ],
)
def test_requests_and_errors_stay(method: str, route: str, status: str) -> None:
    assert not logs.routine_access_line(_access_line(method, route, status))


def test_only_access_lines_are_judged() -> None:
    """A line of ours or of Serve that reads like an access line is no access line."""
    assert not logs.routine_access_line(logging.makeLogRecord({"msg": "CALL load OK 1.0ms"}))
    short = logging.makeLogRecord({"msg": "load OK", "serve_access_log": True})
    assert not logs.routine_access_line(short)


def test_the_internal_calls_are_the_replicas_methods() -> None:
    assert all(callable(getattr(ReplicaProtocol, name, None)) for name in logs.INTERNAL_CALLS)


@pytest.fixture
def serve_logger() -> Iterator[logging.Logger]:
    """Serve's logger as a replica has it, and ours, restored afterwards (log_through_serve
    changes both for the process)."""
    serve, ours = logging.getLogger(logs.SERVE_LOGGER), logging.getLogger(logs.OUR_LOGGER)
    saved = (serve.filters[:], serve.handlers[:], serve.propagate, serve.level)
    saved_ours = (ours.handlers[:], ours.propagate, ours.level)
    try:
        yield serve
    finally:
        serve.filters[:], serve.handlers[:], serve.propagate, level = saved
        serve.setLevel(level)
        ours.handlers[:], ours.propagate, level = saved_ours
        ours.setLevel(level)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_replica_log_keeps_requests_and_errors_only(serve_logger: logging.Logger) -> None:
    logs.log_through_serve()
    logs.log_through_serve()  # a second replica constructor in the same worker adds nothing
    # Serve replaces its handlers when a config changes its logging_config (logging_utils'
    # configure_component_logger clears them); the filter is the logger's and stays.
    serve_logger.handlers.clear()
    kept = _Kept()
    serve_logger.addHandler(kept)
    serve_logger.propagate = False
    serve_logger.setLevel(logging.INFO)
    extra = {"serve_access_log": True}
    for method, route, status in [
        ("CALL", "load", "OK"),
        ("GET", "/metrics", "200"),
        ("POST", "/wim", "200"),
        ("CALL", "claim", "OK"),
        ("CALL", "claim", "ERROR"),
    ]:
        serve_logger.info(
            access_log_msg(method=method, route=route, status=status, latency_ms=2.0),
            extra=extra,
        )
    logging.getLogger("wim_service.serving.routing").warning("a session moved")
    assert kept.lines == ["POST /wim 200 2.0ms", "CALL claim ERROR 2.0ms", "a session moved"]
