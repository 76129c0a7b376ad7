"""Limits at the edge: a request body larger than the service takes is refused unread."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.errors import HTTPFailure, ServiceCode


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 from `Content-Length` before any byte is read; a chunked body is counted as it
    arrives and refused as soon as it passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self) -> HTTPFailure:
        return HTTPFailure(
            ServiceCode.BODY_TOO_LARGE,
            f"the request body is larger than this service takes ({self.max_bytes} bytes)",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refusal().response()(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:
            if not started:
                await self._refusal().response()(scope, receive, send)
