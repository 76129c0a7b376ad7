"""The edge: what every request must pass before a byte of its body is read.

Each route has one `RouteEdge`: whether it needs an API key, the largest body it takes, and the
shape its errors come in. `EdgeMiddleware` authenticates from the headers alone (an unknown
caller never gets its body parsed), then refuses a body past the route's cap: from
`Content-Length` before reading, or, chunked, as soon as the count passes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.http.auth import Tenant
from wim_service.serving.http.errors import HTTPFailure, ServiceCode

# Routes that take no body (GET, DELETE, the page and probes) still get a cap: a client may
# send one anyway.
SMALL_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class RouteEdge:
    authenticated: bool  # needs an API key (in open mode anyone passes)
    max_body_bytes: int
    openai: bool = False  # errors in OpenAI's shape (`/v1/*`)


# The route's edge for (method, path); the route's error response for a refusal.
EdgeOf = Callable[[str, str], RouteEdge]
Refusal = Callable[[RouteEdge, HTTPFailure], Response]
Authenticate = Callable[[str | None], Awaitable[Tenant]]


def caller(request: Request) -> Tenant:
    """The caller's tenant, as `EdgeMiddleware` authenticated it from the headers."""
    tenant: Tenant = request.state.tenant
    return tenant


def body_too_large(max_bytes: int) -> HTTPFailure:
    return HTTPFailure(
        ServiceCode.BODY_TOO_LARGE,
        f"the request body is larger than this route takes ({max_bytes} bytes)",
    )


class EdgeMiddleware:
    """Authentication from the headers, then the route's body cap; the caller's `Tenant` is
    left in the request's state (`state["tenant"]`) for the route."""

    def __init__(
        self, app: ASGIApp, edge_of: EdgeOf, authenticate: Authenticate, refuse: Refusal
    ) -> None:
        self.app = app
        self.edge_of, self.authenticate, self.refuse = edge_of, authenticate, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        edge = self.edge_of(scope["method"], scope["path"])
        headers = dict(scope["headers"])
        if edge.authenticated:
            authorization = headers.get(b"authorization")
            try:
                tenant = await self.authenticate(
                    None if authorization is None else authorization.decode("latin-1")
                )
            except HTTPFailure as exc:
                await self.refuse(edge, exc)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > edge.max_body_bytes):
            await self.refuse(edge, body_too_large(edge.max_body_bytes))(scope, receive, send)
            return
        if declared is not None:
            await self.app(scope, receive, send)  # within the cap: Content-Length bounds it
            return
        await self._chunked(edge, scope, receive, send)

    async def _chunked(self, edge: RouteEdge, scope: Scope, receive: Receive, send: Send) -> None:
        """A body without a length: read it here, counting, and hand it on only if it fits."""
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > edge.max_body_bytes:
                await self.refuse(edge, body_too_large(edge.max_body_bytes))(scope, receive, send)
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
