"""The service's one error: `ServiceError`, a code and a message, and the one table from code
to HTTP status.

Routing, the session store, tenants and the HTTP edge all refuse a request by raising
`ServiceError`; `http/errors.py` answers it as a JSON body `{code, message}` with the status
`STATUS` gives its code (and `openai/errors.py` in OpenAI's shape). This module knows no web
framework, so that every layer of the service may raise it.
"""

from __future__ import annotations

from enum import StrEnum

from wim_service.wim.errors import ErrorCode


class ServiceCode(StrEnum):
    """Codes of the service's own refusals, beside the job codes of `wim.errors.ErrorCode`."""

    INVALID_REQUEST = "invalid_request"  # the body does not match the API's schema
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the route exists, not with this method
    OPTIONS_FIXED = "options_fixed"  # a query changes options fixed when its document was read
    BODY_TOO_LARGE = "body_too_large"
    BODY_TIMEOUT = "body_timeout"  # the body did not arrive within the router's deadline
    TOO_COMPLEX = "too_complex"  # an upload takes more time or memory to read than it is given
    UNAUTHORIZED = "unauthorized"  # no API key, or an unknown one
    FORBIDDEN = "forbidden"  # the tenant may not do this
    RATE_LIMITED = "rate_limited"  # the tenant's own limits
    INTERNAL_ERROR = "internal_error"  # a bug: logged with the request id
    UNSUPPORTED = "unsupported"  # a parameter or value this service cannot honour
    MODEL_NOT_FOUND = "model_not_found"  # the OpenAI API's `model` names no model served here


STATUS: dict[str, int] = {
    ErrorCode.INVALID_INPUT: 400,
    ServiceCode.UNSUPPORTED: 400,
    ServiceCode.UNAUTHORIZED: 401,
    ServiceCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ServiceCode.MODEL_NOT_FOUND: 404,
    ServiceCode.METHOD_NOT_ALLOWED: 405,
    ServiceCode.BODY_TIMEOUT: 408,
    ErrorCode.TOO_LONG: 413,
    ServiceCode.BODY_TOO_LARGE: 413,
    ServiceCode.INVALID_REQUEST: 422,
    ServiceCode.OPTIONS_FIXED: 422,
    ServiceCode.TOO_COMPLEX: 422,
    ErrorCode.OVERLOADED: 429,
    ServiceCode.RATE_LIMITED: 429,
    ErrorCode.CANCELLED: 499,
    ServiceCode.INTERNAL_ERROR: 500,
    ErrorCode.ENGINE_ERROR: 502,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}


def status_of(code: str) -> int:
    """The table's status of `code`; a code missing from the table is a bug: 500."""
    return STATUS.get(code, STATUS[ServiceCode.INTERNAL_ERROR])


class ServiceError(Exception):
    """The one way to fail a request: a code of the table (which gives the status) and a
    message, answered before any byte of a stream was sent. `param` names the request field
    at fault where the API reports it (the OpenAI-compatible routes)."""

    def __init__(
        self,
        code: str,
        message: str,
        retry_after: float | None = None,
        *,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after = str(code), message, retry_after
        self.param = param

    @property
    def status(self) -> int:
        return status_of(self.code)
