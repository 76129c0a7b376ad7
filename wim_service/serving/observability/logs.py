"""This service's log lines in the Serve replica logs.

Serve gives each replica a logger (`ray.serve`) that writes the replica's log file under the
Ray session's `logs/serve/`, at the application's `logging_config` level, with the request id
of the call being served. The `wim_service` loggers had no handler of their own in a replica:
their warnings went to the worker's stderr and their info lines (a session moved to another
replica, a copy opened, orphans closed) nowhere. `log_through_serve` sends them through
Serve's logger, so that an operator reads a failover next to the request that caused it.
Document ids and text never reach these lines (`docs/security.md`).
"""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"
OUR_LOGGER = "wim_service"


class _ThroughServe(logging.Handler):
    """Hands a record to Serve's logger, at that logger's level as it is now (a serve config
    that changes `logging_config` reconfigures Serve's logger, not ours)."""

    def emit(self, record: logging.LogRecord) -> None:
        serve_logger = logging.getLogger(SERVE_LOGGER)
        if serve_logger.isEnabledFor(record.levelno):
            serve_logger.handle(record)


def log_through_serve() -> None:
    """In a Serve replica: the `wim_service` loggers write where Serve's does. Idempotent."""
    ours = logging.getLogger(OUR_LOGGER)
    if any(isinstance(handler, _ThroughServe) for handler in ours.handlers):
        return
    ours.addHandler(_ThroughServe())
    ours.setLevel(logging.DEBUG)  # Serve's logger decides what is written
    ours.propagate = False
