"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every error is raised as the service's one `ServiceError` (its status from the one table,
`serving/errors.py`); the OpenAI routes only present it in OpenAI's shape, with the status the
SDK maps to its exception classes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from wim_service.serving.errors import STATUS, ServiceCode, ServiceError
from wim_service.serving.http.errors import framework_failure, invalid_request, retry_after_headers
from wim_service.serving.openai.models import ErrorResponse
from wim_service.wim.errors import ErrorCode

# OpenAI clients expect a malformed request as a bad request (not the table's 422) and a prompt
# too long for the window as a bad request `context_length_exceeded`.
BAD_REQUEST = STATUS[ErrorCode.INVALID_INPUT]
_AS_BAD_REQUEST = {STATUS[ServiceCode.INVALID_REQUEST]}
_OPENAI_CODES = {ErrorCode.TOO_LONG: "context_length_exceeded"}
_TYPES = {
    STATUS[ServiceCode.UNAUTHORIZED]: "authentication_error",
    STATUS[ServiceCode.FORBIDDEN]: "permission_error",
    STATUS[ServiceCode.RATE_LIMITED]: "rate_limit_error",
}


@dataclass(frozen=True)
class OpenAIError:
    """A `ServiceError` as OpenAI answers it."""

    status: int
    code: str
    message: str
    param: str | None = None
    retry_after: float | None = None

    @classmethod
    def of(cls, failure: ServiceError) -> OpenAIError:
        status, code = failure.status, failure.code
        if code in _OPENAI_CODES:
            status, code = BAD_REQUEST, _OPENAI_CODES[ErrorCode(code)]
        elif status in _AS_BAD_REQUEST:
            status = BAD_REQUEST
        return cls(status, code, failure.message, failure.param, failure.retry_after)

    @property
    def type(self) -> str:
        fallback = "invalid_request_error" if self.status < 500 else "server_error"
        return _TYPES.get(self.status, fallback)

    def body(self) -> dict[str, Any]:
        return ErrorResponse.of(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers=retry_after_headers(self.retry_after)
        )


class OpenAIRoute(APIRoute):
    """Answers every error of its routes (authentication included) in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ServiceError as exc:
                return OpenAIError.of(exc).response()
            except RequestValidationError as exc:
                return OpenAIError.of(invalid_request(exc)).response()
            except StarletteHTTPException as exc:  # e.g. a body that is not UTF-8
                return OpenAIError.of(framework_failure(exc)).response()

        return route
