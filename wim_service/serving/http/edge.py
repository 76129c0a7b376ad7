"""The edge: what every request must pass before a byte of its body reaches a route.

Each route has one `RouteEdge`: whether it needs an API key, the largest body it takes, and the
shape its errors come in. `EdgeMiddleware` authenticates from the headers alone (an unknown
caller never gets its body parsed), counts the request against its tenant's open requests on
this router, then reads the body itself and hands it on whole only if it fits the route's cap
(from `Content-Length` before reading, or as soon as the count passes it) and arrived within
the body deadline. A client that sends its body slowly, or part of it and then nothing, is
answered 408 and its connection closed: it holds a router slot for that long at most.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.tenants import Tenant

# Routes that take no body (GET, DELETE, the page and probes) still get a cap: a client may
# send one anyway.
SMALL_BODY_BYTES = 64 * 1024
# A tenant past its open requests is told to come back this much later.
OPEN_REQUESTS_RETRY_S = 1.0


@dataclass(frozen=True)
class RouteEdge:
    authenticated: bool  # needs an API key (in open mode anyone passes)
    max_body_bytes: int
    openai: bool = False  # errors in OpenAI's shape (`/v1/*`)


# The route's edge for (method, path); the route's error response for a refusal.
EdgeOf = Callable[[str, str], RouteEdge]
Refusal = Callable[[RouteEdge, ServiceError], Response]
Authenticate = Callable[[str | None], Awaitable[Tenant]]


def caller(request: Request) -> Tenant:
    """The caller's tenant, as `EdgeMiddleware` authenticated it from the headers."""
    tenant: Tenant = request.state.tenant
    return tenant


def body_too_large(max_bytes: int) -> ServiceError:
    return ServiceError(
        ServiceCode.BODY_TOO_LARGE,
        f"the request body is larger than this route takes ({max_bytes} bytes)",
    )


def body_too_slow(timeout_s: float) -> ServiceError:
    return ServiceError(
        ServiceCode.BODY_TIMEOUT, f"the request body did not arrive within {timeout_s:g} s"
    )


def too_many_open(limit: int) -> ServiceError:
    return ServiceError(
        ServiceCode.RATE_LIMITED,
        f"this tenant has {limit} requests open on this router, its limit; wait for one to finish",
        OPEN_REQUESTS_RETRY_S,
    )


class EdgeMiddleware:
    """Authentication from the headers, the tenant's open requests, then the route's body cap
    and the body deadline; the caller's `Tenant` is left in the request's state
    (`state["tenant"]`) for the route."""

    def __init__(
        self,
        app: ASGIApp,
        edge_of: EdgeOf,
        authenticate: Authenticate,
        refuse: Refusal,
        *,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.edge_of, self.authenticate, self.refuse = edge_of, authenticate, refuse
        self.body_timeout_s = body_timeout_s
        # Tenant -> its requests open on this router, from authentication to the last byte
        # of the answer (a streamed one included).
        self.open_requests: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        edge = self.edge_of(scope["method"], scope["path"])
        headers = dict(scope["headers"])
        tenant: Tenant | None = None
        if edge.authenticated:
            authorization = headers.get(b"authorization")
            try:
                tenant = await self.authenticate(
                    None if authorization is None else authorization.decode("latin-1")
                )
            except ServiceError as exc:
                await self._refuse(edge, exc, scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > edge.max_body_bytes):
            await self._refuse(edge, body_too_large(edge.max_body_bytes), scope, receive, send)
            return
        if tenant is None:
            await self._with_body(edge, scope, receive, send)
            return
        limit = tenant.limits.open_requests
        if self.open_requests[tenant.name] >= limit:
            await self._refuse(edge, too_many_open(limit), scope, receive, send)
            return
        self.open_requests[tenant.name] += 1
        try:
            await self._with_body(edge, scope, receive, send)
        finally:
            self.open_requests[tenant.name] -= 1
            if not self.open_requests[tenant.name]:
                del self.open_requests[tenant.name]

    async def _with_body(self, edge: RouteEdge, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body within the deadline and the cap, then run the route on it."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _read_body(edge, receive)
        except TimeoutError:
            await self._refuse(edge, body_too_slow(self.body_timeout_s), scope, receive, send)
            return
        if body is None:
            return  # the client went away
        if isinstance(body, ServiceError):
            await self._refuse(edge, body, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # e.g. http.disconnect while the answer streams
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(
        self, edge: RouteEdge, failure: ServiceError, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Answer `failure` in the route's shape and close the connection: the body, unread
        or read in part, may never end, and the HTTP server would otherwise keep waiting on
        the connection for it."""
        refusal = self.refuse(edge, failure)
        refusal.headers["connection"] = "close"
        await refusal(scope, receive, send)


async def _read_body(edge: RouteEdge, receive: Receive) -> bytes | ServiceError | None:
    """The body, counted against the route's cap whatever `Content-Length` said: the refusal
    as soon as it passes the cap (the rest is never asked for); None if the client left."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > edge.max_body_bytes:
            return body_too_large(edge.max_body_bytes)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)
