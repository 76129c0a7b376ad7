"""The ingress: the HTTP API built over a `WiMRouter`, and the Serve deployment class that
holds the router and builds the app when its replica starts.

The router holds the logic and knows no HTTP app; `build_http_app` wraps it in routes, the
edge (authentication, body limits) and the error handlers. Serve calls
`WiMIngress.__serve_build_asgi_app__` after the constructor; tests build the same app over a
router with fake replicas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel

from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import STATUS, ServiceError
from wim_service.serving.http.bodies import (
    DocumentRequest,
    DocumentResponse,
    ErrorBody,
    WiMRequest,
    WiMResponse,
)
from wim_service.serving.http.docs_page import docs_page
from wim_service.serving.http.edge import (
    SMALL_BODY_BYTES,
    EdgeMiddleware,
    EdgeOf,
    RouteEdge,
    caller,
)
from wim_service.serving.http.errors import error_response, install_error_handlers
from wim_service.serving.http.page import extract_routes, install_page
from wim_service.serving.http.responses import json_response, sse_response
from wim_service.serving.observability.logs import log_through_serve
from wim_service.serving.openai.errors import OpenAIError
from wim_service.serving.openai.models import ErrorResponse
from wim_service.serving.openai.routes import openai_routes
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import Tenant

# A route parameter of this type is the authenticated caller (in open mode: anyone).
Caller = Annotated[Tenant, Depends(caller)]


def route_edges(config: RouterConfig) -> EdgeOf:
    """Each route's edge: the API routes need a key and take documents in their bodies; the
    page, its files, the probes, `/metrics` (unless `metrics_require_key`) and the API's own
    docs are public and take no body. One table, so that no route is left out of
    authentication by accident."""
    documents = RouteEdge(authenticated=True, max_body_bytes=config.max_body_bytes)
    openai = RouteEdge(authenticated=True, max_body_bytes=config.max_body_bytes, openai=True)
    keyed = RouteEdge(authenticated=True, max_body_bytes=SMALL_BODY_BYTES)
    public = RouteEdge(authenticated=False, max_body_bytes=SMALL_BODY_BYTES)

    def edge_of(method: str, path: str) -> RouteEdge:
        if path.startswith("/v1/"):
            return openai if method == "POST" else replace(openai, max_body_bytes=SMALL_BODY_BYTES)
        if path in ("/wim", "/documents", "/extract/pdf"):
            return documents if method == "POST" else keyed
        if path.startswith("/documents/") or (path == "/metrics" and config.metrics_require_key):
            return keyed
        return public

    return edge_of


def refusal(edge: RouteEdge, failure: ServiceError) -> Response:
    """A refusal at the edge in the route's own error shape."""
    return OpenAIError.of(failure).response() if edge.openai else error_response(failure)


class Readiness(BaseModel):
    ready: bool
    replicas: list[str]


def error_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of every error status in the one table (`errors.STATUS`), each
    with the codes it stands for, answered as `model`."""
    codes: dict[int, list[str]] = {}
    for code, status in STATUS.items():
        codes.setdefault(status, []).append(str(code))
    return {
        status: {"model": model, "description": "code: " + ", ".join(sorted(names))}
        for status, names in sorted(codes.items())
    }


# Every route behind an API key may answer any of them (its own 422 included, which replaces
# FastAPI's `detail` schema).
API_ERRORS = error_responses(ErrorBody)


def _lifespan(router: WiMRouter) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The loop that serves the app (Serve's replica, uvicorn, a TestClient's) runs its
        # lifespan; the router may have been built off it (tests build it in their own thread).
        router.start()
        try:
            yield
        finally:
            await router.reach.withdraw()  # its peers stop counting it as a witness
            router.shutdown()  # Serve runs this when the router replica stops

    return lifespan


def build_http_app(router: WiMRouter) -> FastAPI:
    """The service's ASGI app over `router`."""
    app = FastAPI(
        title="wim_service",
        summary="Long-document question answering with Writing in the Margins on vLLM.",
        description=(
            'One-shot: `POST /wim {"context": "...", "query": "..."}`. '
            "Many queries on one document: `POST /documents`, then `POST /wim` with its "
            '`document_id`. Add `"stream": true` for server-sent events.'
        ),
        version="0.1.0",
        lifespan=_lifespan(router),
        # `/docs` is ours (under a Content-Security-Policy, `http/docs_page.py`); no ReDoc.
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        EdgeMiddleware,
        edge_of=route_edges(router.config.router),
        authenticate=router.authenticate,
        refuse=refusal,
        body_timeout_s=router.config.router.body_timeout_s,
    )
    # Its request-id middleware goes outermost; it also names the router replica that
    # answered (several share one address behind Serve's proxy).
    install_error_handlers(app, {"X-WiM-Router": router.name})
    app.include_router(
        openai_routes(router),
        responses=error_responses(ErrorResponse),  # the same statuses, in OpenAI's shape
    )
    app.include_router(extract_routes(router.gate.job, router.pdf.extract), responses=API_ERRORS)
    install_page(app)
    app.include_router(wim_routes(router), responses=API_ERRORS)
    app.include_router(probe_routes(router))

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return docs_page(app.openapi_url or "/openapi.json", app.title)

    return app


def wim_routes(router: WiMRouter) -> APIRouter:
    """`POST /wim` and the document sessions."""
    api = APIRouter()

    @api.post(
        "/wim",
        response_model=WiMResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def wim(body: WiMRequest, caller: Caller) -> Response:
        """Answer a query about a document: one-shot (`context`) or a session (`document_id`)."""
        session_id, items = await router.start_job(body, caller)
        if body.stream:
            return sse_response(items, session_id, router.config.router.stream_heartbeat_s)
        return await json_response(items, session_id)

    @api.post("/documents", response_model=DocumentResponse, status_code=201)
    async def create_document(body: DocumentRequest, caller: Caller) -> DocumentResponse:
        """Read a document once and pin its KV on one engine replica for later queries."""
        return await router.create_document(body, caller)

    @api.get("/documents/{document_id}", response_model=DocumentResponse)
    async def get_document(document_id: str, caller: Caller) -> DocumentResponse:
        return await router.get_document(document_id, caller)

    @api.delete("/documents/{document_id}", status_code=204)
    async def delete_document(document_id: str, caller: Caller) -> Response:
        """End a document session: its KV is freed and purged from the engine's cache."""
        await router.delete_document(document_id, caller)
        return Response(status_code=204)

    return api


def probe_routes(router: WiMRouter) -> APIRouter:
    """The public probes and the Prometheus scrape."""
    api = APIRouter()

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz() -> JSONResponse:
        ready = await router.ready_replicas()
        return JSONResponse(
            {"ready": bool(ready), "replicas": ready}, status_code=200 if ready else 503
        )

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text: the WiM metrics and every replica's `vllm:*` metrics."""
        return Response(
            await router.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return api


class WiMIngress:
    """The Serve ingress (`serving/app.py`): a `WiMRouter`, and the HTTP app over it, built
    when the replica starts."""

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        """`engine` is the EngineReplica deployment's handle; `config` a `ServiceConfig`."""
        log_through_serve()
        self.router = WiMRouter(engine, config)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.router)

    async def check_health(self) -> None:
        """Serve's health check: it fails while this router alone cannot reach the session
        store (`routing/store_reach.py`), so that Serve's proxies stop sending it requests."""
        await self.router.reach.check()
