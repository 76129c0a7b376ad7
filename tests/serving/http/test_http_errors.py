"""The error table's handlers (`serving/http/errors.py`) on a small app: a body that does not
match its schema, and what the web framework refuses itself, come back as `{code, message}` with
the table's status; a failure after a stream began becomes an `error` event
(`serving/http/responses.py`); a body over the limit is refused with 413
(`serving/http/edge.py`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from wim_service.serving.errors import ServiceCode, ServiceError, status_of
from wim_service.serving.http.edge import EdgeMiddleware, RouteEdge
from wim_service.serving.http.errors import error_response, install_error_handlers
from wim_service.serving.http.responses import first_item, with_late_errors
from wim_service.serving.tenants import Tenant, TenantLimits
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import AnswerEvent, ErrorEvent, SegmentEvent, WiMEvent


class Inner(BaseModel):
    count: int


class Body(BaseModel):
    name: str
    inner: Inner


def error_app() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/items")
    async def items(body: Body) -> dict[str, str]:
        return {"name": body.name}

    @app.get("/refuse/{status}")
    async def refuse(status: int) -> None:
        raise StarletteHTTPException(status, detail=f"refused with {status}")

    return TestClient(app)


def test_a_body_off_its_schema_names_every_problem_by_field() -> None:
    response = error_app().post("/items", json={"inner": {"count": "many"}})
    assert response.status_code == 422
    assert response.json() == {
        "code": "invalid_request",
        "message": "name: Field required; "
        "inner.count: Input should be a valid integer, unable to parse string as an integer",
    }


def test_a_body_that_is_not_an_object_is_named_body() -> None:
    response = error_app().post("/items", json=[1])
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_request"
    assert response.json()["message"].startswith("body: Input should be a valid dictionary")


@pytest.mark.parametrize(
    ("status", "code", "answered"),
    [
        (400, "invalid_request", 422),  # the table answers invalid requests with 422
        (404, "not_found", 404),
        (405, "method_not_allowed", 405),
        (418, "invalid_request", 422),  # any other client error
        (499, "invalid_request", 422),
        (500, "internal_error", 500),
        (503, "internal_error", 500),  # the framework's own server errors: a bug of ours
    ],
)
def test_a_refusal_of_the_framework_gets_the_tables_code(
    status: int, code: str, answered: int
) -> None:
    response = error_app().get(f"/refuse/{status}")
    assert response.status_code == answered
    assert response.json() == {"code": code, "message": f"refused with {status}"}


def test_unknown_routes_and_methods_answer_in_the_tables_shape() -> None:
    client = error_app()
    unknown = client.get("/nowhere")
    assert unknown.status_code == 404
    assert unknown.json() == {"code": "not_found", "message": "Not Found"}
    wrong = client.get("/items")
    assert wrong.status_code == 405
    assert wrong.json() == {"code": "method_not_allowed", "message": "Method Not Allowed"}
    assert wrong.headers["Allow"] == "POST"  # the framework's headers are kept


def test_a_code_outside_the_table_is_a_500() -> None:
    assert status_of("a_code_added_later") == 500
    assert error_response(ServiceError("a_code_added_later", "m")).status_code == 500


@pytest.mark.parametrize(("retry_after", "header"), [(0.2, "1"), (1.0, "1"), (2.1, "3")])
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    retry_after: float, header: str
) -> None:
    response = error_response(ServiceError("overloaded", "busy", retry_after))
    assert response.status_code == 429
    assert response.headers["Retry-After"] == header


async def test_a_failure_after_the_first_event_keeps_its_retry_hint() -> None:
    """A stream already under way cannot change its status: the failure becomes an `error`
    event, and an overloaded one still tells the client when to come back."""

    async def rest() -> AsyncIterator[tuple[str, WiMEvent]]:
        yield "replica-a", AnswerEvent(text="The")
        raise WiMError(ErrorCode.OVERLOADED, "KV ran out", retry_after_s=2.5)

    segment = SegmentEvent(
        segment=0, segments=2, tokens=8, context_tokens=8, char_start=0, char_end=30
    )
    first = ("replica-a", segment)
    items = [item async for item in with_late_errors(first, rest())]
    assert items[:2] == [first, ("replica-a", AnswerEvent(text="The"))]
    assert items[2] == (
        "replica-a",
        ErrorEvent(code="overloaded", message="KV ran out", retry_after_s=2.5),
    )
    assert len(items) == 3


async def test_a_failure_before_the_first_event_is_an_http_status() -> None:
    """Nothing was sent yet, so the failure is answered with its status and retry hint."""

    async def refused() -> AsyncIterator[tuple[str, WiMEvent]]:
        raise WiMError(ErrorCode.OVERLOADED, "KV ran out", retry_after_s=2.5)
        yield  # an async generator

    async def empty() -> AsyncIterator[tuple[str, WiMEvent]]:
        return
        yield

    closed: list[bool] = []

    async def error_first() -> AsyncIterator[tuple[str, WiMEvent]]:
        try:
            yield "replica-a", ErrorEvent(code="too_long", message="too long", retry_after_s=None)
            yield "replica-a", AnswerEvent(text="never")
        finally:
            closed.append(True)

    cases = [
        (refused(), ("overloaded", 429, "KV ran out", 2.5)),
        (empty(), ("engine_error", 502, "the job produced no output", None)),
        (error_first(), ("too_long", status_of("too_long"), "too long", None)),
    ]
    for items, expected in cases:
        with pytest.raises(ServiceError) as failure:
            await first_item(items)
        got = failure.value
        assert (got.code, got.status, got.message, got.retry_after) == expected
    assert closed == [True]  # the job's stream was closed at once, not left to the collector

    async def answering() -> AsyncIterator[tuple[str, WiMEvent]]:
        yield "replica-b", AnswerEvent(text="4417")

    assert await first_item(answering()) == ("replica-b", AnswerEvent(text="4417"))


# Body limits at the edge (`serving/http/edge.py`), driven over raw ASGI messages so that each test
# controls how the body arrives: with a Content-Length, chunked, or cut off. The real
# service's 413 over HTTP is in tests/live/test_hostile.py.

LIMIT = 10
BODY_TIMEOUT_S = 60.0


@dataclass
class EchoApp:
    """Answers 200 with the body it read; records every call."""

    calls: list[Scope] = field(default_factory=list)
    after_body: list[Message] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(scope)
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            assert message["type"] == "http.request"
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope.get("receive_after_body"):
            self.after_body.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


@dataclass
class Exchange:
    status: int | None = None
    body: bytes = b""
    received: int = 0  # messages the middleware or the app took from the client


async def no_authentication(_: str | None) -> Tenant:
    raise AssertionError("a public route authenticates nobody")


def body_limit(app: EchoApp) -> EdgeMiddleware:
    """The edge of a public route that takes `LIMIT` bytes."""
    edge = RouteEdge(authenticated=False, max_body_bytes=LIMIT)
    return EdgeMiddleware(
        app,
        lambda _method, _path: edge,
        no_authentication,
        lambda _, failure: error_response(failure),
        body_timeout_s=BODY_TIMEOUT_S,
    )


async def call(
    messages: Iterable[Message], headers: dict[bytes, bytes] | None = None, **scope_extra: object
) -> tuple[Exchange, EchoApp]:
    app = EchoApp()
    pending = list(messages)
    exchange = Exchange()

    async def receive() -> Message:
        exchange.received += 1
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            exchange.status = message["status"]
        else:
            exchange.body += message.get("body", b"")

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/wim",
        "headers": list((headers or {}).items()),
    }
    await body_limit(app)({**scope, **scope_extra}, receive, send)
    return exchange, app


def chunks(*parts: bytes) -> list[Message]:
    return [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]


def assert_refused(exchange: Exchange, app: EchoApp) -> None:
    assert exchange.status == 413
    assert json.loads(exchange.body) == {
        "code": "body_too_large",
        "message": f"the request body is larger than this route takes ({LIMIT} bytes)",
    }
    assert app.calls == []


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    exchange, app = await call(chunks(b"x" * 11), {b"content-length": b"11"})
    assert_refused(exchange, app)
    assert exchange.received == 0


async def test_a_declared_length_that_is_not_a_number_is_refused() -> None:
    exchange, app = await call(chunks(b"x"), {b"content-length": b"1e1"})
    assert_refused(exchange, app)


async def test_a_declared_length_at_the_limit_passes_untouched() -> None:
    exchange, app = await call(chunks(b"0123456789"), {b"content-length": b"10"})
    assert (exchange.status, exchange.body) == (200, b"0123456789")
    assert len(app.calls) == 1


async def test_a_chunked_body_within_the_limit_reaches_the_app_whole() -> None:
    exchange, app = await call(chunks(b"0123", b"4567", b"89"))
    assert (exchange.status, exchange.body) == (200, b"0123456789")
    assert exchange.received == 3 and len(app.calls) == 1


async def test_a_chunked_body_is_refused_at_the_chunk_that_passes_the_limit() -> None:
    exchange, app = await call(chunks(b"0123", b"4567", b"890", b"never read"))
    assert_refused(exchange, app)
    assert exchange.received == 3  # the fourth chunk was never asked for


async def test_a_message_without_a_body_counts_as_empty() -> None:
    # ASGI lets a server leave out "body" (empty) and "more_body" (False).
    exchange, _app = await call(
        [{"type": "http.request", "more_body": True}, {"type": "http.request"}]
    )
    assert (exchange.status, exchange.body) == (200, b"")


async def test_after_the_replayed_body_the_app_hears_the_client() -> None:
    exchange, app = await call(chunks(b"01", b"23"), receive_after_body=True)
    assert (exchange.status, exchange.body) == (200, b"0123")
    assert app.after_body == [{"type": "http.disconnect"}]


async def test_a_client_gone_mid_body_gets_nothing_and_the_app_is_not_called() -> None:
    exchange, app = await call([{"type": "http.request", "body": b"01", "more_body": True}])
    assert exchange.status is None and exchange.body == b""
    assert app.calls == []


async def test_other_scopes_pass_through() -> None:
    app = EchoApp()

    async def receive() -> Message:
        raise AssertionError("a lifespan scope's messages are the app's to read")

    async def send(message: Message) -> None:
        raise AssertionError("nothing to send")

    await body_limit(app)({"type": "lifespan"}, receive, send)
    assert app.calls == [{"type": "lifespan"}]


async def test_an_unknown_caller_is_refused_before_its_body_is_read() -> None:
    app = EchoApp()
    exchange = Exchange()
    edge = RouteEdge(authenticated=True, max_body_bytes=LIMIT)

    async def unknown(authorization: str | None) -> Tenant:
        assert authorization == "Bearer nope"
        raise ServiceError(ServiceCode.UNAUTHORIZED, "unknown API key")

    async def receive() -> Message:
        exchange.received += 1
        return {"type": "http.request", "body": b"x" * 5, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            exchange.status = message["status"]

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/wim",
        "headers": [(b"authorization", b"Bearer nope"), (b"content-length", b"5")],
    }
    middleware = EdgeMiddleware(
        app, lambda _m, _p: edge, unknown, lambda _, f: error_response(f), body_timeout_s=60
    )
    await middleware(scope, receive, send)
    assert exchange.status == 401 and exchange.received == 0 and app.calls == []


class Held:
    """A client that sends the first part of its body, then nothing until `release`."""

    def __init__(self, first: bytes = b"01") -> None:
        self.first, self.release = first, asyncio.Event()
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.sent_first = False

    async def receive(self) -> Message:
        if not self.sent_first:
            self.sent_first = True
            return {"type": "http.request", "body": self.first, "more_body": True}
        await self.release.wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], dict(message["headers"])
        else:
            self.body += message.get("body", b"")


def tenant_edge(app: EchoApp, body_timeout_s: float, open_requests: int = 2) -> EdgeMiddleware:
    """The edge of an authenticated route: the key names the tenant."""
    edge = RouteEdge(authenticated=True, max_body_bytes=LIMIT)

    async def authenticate(authorization: str | None) -> Tenant:
        assert authorization is not None
        name = authorization.removeprefix("Bearer ")
        return Tenant(name, TenantLimits(open_requests=open_requests))

    return EdgeMiddleware(
        app,
        lambda _m, _p: edge,
        authenticate,
        lambda _, failure: error_response(failure),
        body_timeout_s=body_timeout_s,
    )


def scope_of(tenant: str) -> Scope:
    headers = [(b"authorization", f"Bearer {tenant}".encode()), (b"content-length", b"4")]
    return {"type": "http", "method": "POST", "path": "/wim", "headers": headers}


async def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed() -> None:
    app, client = EchoApp(), Held()
    await tenant_edge(app, body_timeout_s=0.05)(scope_of("acme"), client.receive, client.send)
    assert client.status == 408 and client.headers[b"connection"] == b"close"
    assert json.loads(client.body) == {
        "code": "body_timeout",
        "message": "the request body did not arrive within 0.05 s",
    }
    assert app.calls == []


async def test_a_tenants_open_requests_are_bounded_and_others_pass() -> None:
    """Two held bodies of acme's fill its open requests: its third is refused at once (429),
    globex is served meanwhile, and acme's count drops back as its requests end."""
    app = EchoApp()
    middleware = tenant_edge(app, body_timeout_s=60, open_requests=2)
    held = [Held(), Held()]
    holding = [asyncio.create_task(middleware(scope_of("acme"), c.receive, c.send)) for c in held]
    while not all(c.sent_first for c in held):
        await asyncio.sleep(0)
    third = Held()
    await middleware(scope_of("acme"), third.receive, third.send)
    assert third.status == 429 and json.loads(third.body)["code"] == "rate_limited"
    other = Held(b"0123")
    other.release.set()
    await middleware(scope_of("globex"), other.receive, other.send)
    assert (other.status, other.body) == (200, b"0123")
    for client in held:
        client.release.set()
    await asyncio.gather(*holding)
    assert [c.status for c in held] == [200, 200] and middleware.open_requests == {}
