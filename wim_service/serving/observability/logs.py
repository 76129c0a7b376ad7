"""This service's log lines in the Serve replica logs.

Serve gives each replica a logger (`ray.serve`) that writes the replica's log file under the
Ray session's `logs/serve/`, at the application's `logging_config` level, with the request id
of the call being served. The `wim_service` loggers had no handler of their own in a replica:
their warnings went to the worker's stderr and their info lines (a session moved to another
replica, a copy opened, orphans closed) nowhere. `log_through_serve` sends them through
Serve's logger, so that an operator reads a failover next to the request that caused it.
Document ids and text never reach these lines (`docs/security.md`).

Serve also writes an access line for every call a replica answers. The router asks each engine
replica for its load and claims its sessions every poll, a Prometheus scrape fans out to every
replica, and probes come every few seconds: an idle service printed lines forever, and a
request or an error scrolled away among them. `log_through_serve` leaves those routine lines
out of the replica's log (its stderr, which `serve run` prints, and its file); requests,
errors and every other line stay.
"""

from __future__ import annotations

import logging
import os

SERVE_LOGGER = "ray.serve"
OUR_LOGGER = "wim_service"
VLLM_LOGGER = "vllm"
# What the router, the scrape and the probes call on their own, on a timer: methods of
# `ReplicaProtocol` (named here, not imported: `replica/` imports this package) and routes.
INTERNAL_CALLS = frozenset({"load", "claim", "metrics_text"})
INTERNAL_ROUTES = frozenset({"/metrics", "/healthz", "/readyz"})
# A call that answered, or that its caller gave up on (a probe's own timeout, a poll the router
# stopped waiting for): the caller says so itself if it matters.
ROUTINE_STATUSES = frozenset({"OK", "CANCELLED"})


class _ThroughServe(logging.Handler):
    """Hands a record to Serve's logger, at that logger's level as it is now (a serve config
    that changes `logging_config` reconfigures Serve's logger, not ours)."""

    def emit(self, record: logging.LogRecord) -> None:
        serve_logger = logging.getLogger(SERVE_LOGGER)
        if serve_logger.isEnabledFor(record.levelno):
            serve_logger.handle(record)


def routine_access_line(record: logging.LogRecord) -> bool:
    """Whether `record` is Serve's access line of an internal call that went as it should.

    Serve formats them `[client] METHOD ROUTE STATUS LATENCYms`, `METHOD` being `CALL` and
    `ROUTE` the method's name for a call through a handle."""
    if not getattr(record, "serve_access_log", False):
        return False
    words = record.getMessage().split()
    if len(words) < 4:
        return False
    method, target, status = words[-4:-1]
    internal = INTERNAL_CALLS if method == "CALL" else INTERNAL_ROUTES
    return target in internal and (status in ROUTINE_STATUSES or status.startswith("2"))


class _WithoutRoutineAccessLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not routine_access_line(record)


def log_through_serve() -> None:
    """In a Serve replica: the `wim_service` loggers write where Serve's does, and Serve's
    logger leaves out the routine access lines. Idempotent."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    # On the logger, not its handlers: Serve replaces those when a config changes its
    # `logging_config`, and keeps the logger's filters.
    if not any(isinstance(f, _WithoutRoutineAccessLines) for f in serve_logger.filters):
        serve_logger.addFilter(_WithoutRoutineAccessLines())
    _through_serve(OUR_LOGGER, logging.DEBUG)  # Serve's logger decides what is written


def _through_serve(name: str, level: int) -> None:
    """The logger `name` writes through Serve's, from `level` up, and nowhere else."""
    logger = logging.getLogger(name)
    if any(isinstance(handler, _ThroughServe) for handler in logger.handlers):
        return
    logger.addHandler(_ThroughServe())
    logger.setLevel(level)
    logger.propagate = False


def keep_serve_logs_from_vllm() -> None:
    """In a Serve replica, before its vLLM engine is built: vLLM's own logging config would
    close every handler of the process (`logging.config.dictConfig` does), Serve's among them.
    The replica's log then stopped at its first line, and Serve's controller, once restarted
    (the head host back), failed to recover the replica (it asks for its log file's path, of
    the closed handler) and replaced it. vLLM configures no logging here (its engine-core
    process inherits that: its warnings and errors still reach the worker's stderr) and its
    lines go through Serve's logger, from INFO up. Idempotent."""
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    _through_serve(VLLM_LOGGER, logging.INFO)
