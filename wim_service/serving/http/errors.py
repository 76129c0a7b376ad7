"""Errors as the HTTP API answers them: one table from error code to HTTP status.

Every error a client can see is a JSON body `{code, message}` with the status `STATUS` gives
its code; overload answers carry `Retry-After`. Nothing else reaches a client: an unexpected
exception is logged with the request's id (`X-Request-ID`, also sent back in the response)
and answered as `internal_error` without detail.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import secrets
from enum import StrEnum
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.http.bodies import ErrorBody
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class ServiceCode(StrEnum):
    """Codes of the HTTP layer, beside the job codes of `wim.errors.ErrorCode`."""

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


def retry_after_headers(retry_after: float | None) -> dict[str, str]:
    """`Retry-After` in whole seconds (at least 1), if the error has one."""
    if retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(retry_after)))}


class HTTPFailure(Exception):
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

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            ErrorBody(code=self.code, message=self.message).model_dump(),
            status_code=self.status,
            headers={**(headers or {}), **retry_after_headers(self.retry_after)},
        )


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "")


async def _http_failure(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPFailure)
    return exc.response()


# pydantic names the member of a union that failed in an error's location ("str",
# "list[str]", "function-after[_utf8(), str]"): not a parameter's name.
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|none|list|dict)$|[\[(]")


def field_path(location: tuple[Any, ...]) -> str:
    """A validation error's location as a dotted field path, union members left out."""
    return ".".join(
        str(part) for part in location if not (isinstance(part, str) and _UNION_MEMBER.search(part))
    )


def invalid_request(exc: RequestValidationError) -> HTTPFailure:
    """A body that does not match its schema: every problem, and the first field at fault (a
    JSON syntax error's location is a character position: no field)."""
    errors = exc.errors()
    message = "; ".join(f"{field_path(e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
    where = errors[0]["loc"][1:] if errors else ()
    param = field_path(where) if where and isinstance(where[0], str) else None
    return HTTPFailure(ServiceCode.INVALID_REQUEST, message, param=param or None)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return invalid_request(exc).response()


# What the web framework refuses itself (a body it cannot decode, an unknown route, a wrong
# method), as codes of the table.
_FRAMEWORK_CODES = {
    400: ServiceCode.INVALID_REQUEST,
    404: ErrorCode.NOT_FOUND,
    405: ServiceCode.METHOD_NOT_ALLOWED,
}


def framework_failure(exc: StarletteHTTPException) -> HTTPFailure:
    """A refusal of the web framework as the table's code."""
    fallback = ServiceCode.INVALID_REQUEST if exc.status_code < 500 else ServiceCode.INTERNAL_ERROR
    return HTTPFailure(_FRAMEWORK_CODES.get(exc.status_code, fallback), str(exc.detail))


async def _framework(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return framework_failure(exc).response(dict(exc.headers or {}))


async def _unexpected(
    request: Request, exc: Exception, headers: dict[str, str] | None = None
) -> JSONResponse:
    # Starlette answers this one from its outermost middleware, past RequestIdMiddleware: the
    # id and the app's headers (which router wrote the log line) are added here.
    rid = request_id(request)
    logger.error("request %s failed", rid, exc_info=exc)
    return HTTPFailure(
        ServiceCode.INTERNAL_ERROR, f"internal error; the server log has request id {rid}"
    ).response({REQUEST_ID_HEADER: rid, **(headers or {})})


class RequestIdMiddleware:
    """Gives every request an id (the client's `X-Request-ID` if well-formed) and sends it
    back as a response header, so that a client's report finds the server's log lines."""

    def __init__(self, app: ASGIApp, headers: dict[str, str] | None = None) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(REQUEST_ID_HEADER.lower().encode(), b"")
        given = raw.decode("latin-1")  # any bytes decode; an id not of the form is replaced
        rid = given if _CLIENT_REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.lower().encode(), rid.encode()))
                headers.extend(self.headers)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_error_handlers(app: FastAPI, headers: dict[str, str] | None = None) -> None:
    """The error table's handlers, and request ids (plus `headers`) on every response."""
    app.add_exception_handler(HTTPFailure, _http_failure)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _framework)
    app.add_exception_handler(Exception, functools.partial(_unexpected, headers=headers))
    app.add_middleware(RequestIdMiddleware, headers=headers)
