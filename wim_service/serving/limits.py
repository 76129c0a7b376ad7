"""Limits at the edge: a request body larger than the service takes is refused unread."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.errors import HTTPFailure, ServiceCode


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
        if declared is not None:
            await self.app(scope, receive, send)  # within the limit: Content-Length bounds it
            return
        # A chunked body: read it here, counting, and hand it on only if it fits.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refusal().response()(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # e.g. http.disconnect while the answer streams
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
