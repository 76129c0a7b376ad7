"""Errors as the HTTP API answers them.

Every error a client can see is a `ServiceError` (`serving/errors.py`), answered as a JSON body
`{code, message}` with the status the table gives its code; overload answers carry
`Retry-After`. Nothing else reaches a client: an unexpected exception is logged with the
request's id (`X-Request-ID`, also sent back in the response) and answered as
`internal_error` without detail.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.http.bodies import ErrorBody
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def retry_after_headers(retry_after: float | None) -> dict[str, str]:
    """`Retry-After` in whole seconds (at least 1), if the error has one."""
    if retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(retry_after)))}


def error_response(error: ServiceError, headers: dict[str, str] | None = None) -> JSONResponse:
    """`error` as the API answers it: `{code, message}` with the table's status."""
    return JSONResponse(
        ErrorBody(code=error.code, message=error.message).model_dump(),
        status_code=error.status,
        headers={**(headers or {}), **retry_after_headers(error.retry_after)},
    )


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "")


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(exc)


# pydantic names the member of a union that failed in an error's location ("str",
# "list[str]", "function-after[_utf8(), str]"): not a parameter's name.
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|none|list|dict)$|[\[(]")


def field_path(location: tuple[Any, ...]) -> str:
    """A validation error's location as a dotted field path, union members left out."""
    return ".".join(
        str(part) for part in location if not (isinstance(part, str) and _UNION_MEMBER.search(part))
    )


def invalid_request(exc: RequestValidationError) -> ServiceError:
    """A body that does not match its schema: every problem, and the first field at fault (a
    JSON syntax error's location is a character position: no field)."""
    errors = exc.errors()
    message = "; ".join(f"{field_path(e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
    where = errors[0]["loc"][1:] if errors else ()
    param = field_path(where) if where and isinstance(where[0], str) else None
    return ServiceError(ServiceCode.INVALID_REQUEST, message, param=param or None)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(invalid_request(exc))


# What the web framework refuses itself (a body it cannot decode, an unknown route, a wrong
# method), as codes of the table.
_FRAMEWORK_CODES = {
    400: ServiceCode.INVALID_REQUEST,
    404: ErrorCode.NOT_FOUND,
    405: ServiceCode.METHOD_NOT_ALLOWED,
}


def framework_failure(exc: StarletteHTTPException) -> ServiceError:
    """A refusal of the web framework as the table's code."""
    fallback = ServiceCode.INVALID_REQUEST if exc.status_code < 500 else ServiceCode.INTERNAL_ERROR
    return ServiceError(_FRAMEWORK_CODES.get(exc.status_code, fallback), str(exc.detail))


async def _framework(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(framework_failure(exc), dict(exc.headers or {}))


async def _unexpected(
    request: Request, exc: Exception, headers: dict[str, str] | None = None
) -> JSONResponse:
    # Starlette answers this one from its outermost middleware, past RequestIdMiddleware: the
    # id and the app's headers (which router wrote the log line) are added here.
    rid = request_id(request)
    logger.error("request %s failed", rid, exc_info=exc)
    failure = ServiceError(
        ServiceCode.INTERNAL_ERROR, f"internal error; the server log has request id {rid}"
    )
    return error_response(failure, {REQUEST_ID_HEADER: rid, **(headers or {})})


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
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _framework)
    app.add_exception_handler(Exception, functools.partial(_unexpected, headers=headers))
    app.add_middleware(RequestIdMiddleware, headers=headers)
