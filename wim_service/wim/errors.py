"""Errors a job can end with. Each carries a stable `code`; the serving layer maps codes to HTTP."""

from __future__ import annotations

import logging
import secrets
from enum import StrEnum

logger = logging.getLogger(__name__)


class ErrorCode(StrEnum):
    INVALID_INPUT = "invalid_input"  # malformed request: empty document, bad options
    TOO_LONG = "too_long"  # the job cannot fit the model's context window
    OVERLOADED = "overloaded"  # no KV capacity now; retry later
    NOT_FOUND = "not_found"  # no such document session (unknown, expired or deleted)
    CANCELLED = "cancelled"  # the caller went away
    ENGINE_ERROR = "engine_error"  # the engine failed; the job's work is lost
    UNAVAILABLE = "unavailable"  # no engine can take work now (starting, replaced, store down)
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the job ran past its deadline and was stopped


class WiMError(Exception):
    """A job-ending error with a client-presentable message."""

    def __init__(self, code: ErrorCode, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def logged_failure(
    code: ErrorCode,
    message: str,
    exc: BaseException,
    subject: str,
    *,
    retry_after_s: float | None = None,
) -> WiMError:
    """The error a client is told of a failure it did not cause: `message` and an incident id
    (and `retry_after_s`, when sending it again later may well work).

    The exception's own text (a path, a traceback, engine internals, another request's data)
    goes to the server log under that id, with `subject` (the job, session or context it hit),
    never to the client.
    """
    incident = secrets.token_hex(4)
    logger.error("%s: %s [incident %s]", subject, message, incident, exc_info=exc)
    message = f"{message} (incident {incident} in the server log)"
    return WiMError(code, message, retry_after_s=retry_after_s)
