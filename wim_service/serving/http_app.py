"""The HTTP API: routes over a `WiMRouter`, built when the ingress replica starts.

Serve calls `WiMRouter.__serve_build_asgi_app__` after the router's constructor; tests can
build the same app over a router with fake replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from wim_service.serving.api import (
    DocumentRequest,
    DocumentResponse,
    ErrorBody,
    WiMRequest,
    WiMResponse,
)
from wim_service.serving.auth import Tenant
from wim_service.serving.errors import STATUS, install_error_handlers
from wim_service.serving.limits import BodyLimitMiddleware
from wim_service.serving.openai_api import openai_routes
from wim_service.serving.openai_models import ErrorResponse
from wim_service.serving.page import extract_routes, install_page

if TYPE_CHECKING:
    from wim_service.serving.router import WiMRouter


async def authenticate(request: Request) -> Tenant:
    """The caller's tenant (401 without a valid key), counted against its request rate."""
    router: WiMRouter = request.app.state.wim_router
    caller = router.authenticate(request.headers.get("authorization"))
    request.state.tenant = caller
    return caller


# A route parameter of this type requires a valid API key (in open mode: anyone).
Caller = Annotated[Tenant, Depends(authenticate)]


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


def build_http_app(router: WiMRouter) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Serve runs this when the router replica stops: no PDF worker outlives the router.
        router.pdf.close()

    app = FastAPI(
        title="wim_service",
        summary="Long-document question answering with Writing in the Margins on vLLM.",
        description=(
            'One-shot: `POST /wim {"context": "...", "query": "..."}`. '
            "Many queries on one document: `POST /documents`, then `POST /wim` with its "
            '`document_id`. Add `"stream": true` for server-sent events.'
        ),
        version="0.1.0",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=router.config.router.max_body_bytes)
    # Its request-id middleware goes outermost; it also names the router replica that
    # answered (several share one address behind Serve's proxy).
    install_error_handlers(app, {"X-WiM-Router": router.name})
    app.state.wim_router = router
    app.include_router(
        openai_routes(router),
        dependencies=[Depends(authenticate)],
        responses=error_responses(ErrorResponse),  # the same statuses, in OpenAI's shape
    )
    app.include_router(extract_routes(), dependencies=[Depends(authenticate)], responses=API_ERRORS)
    install_page(app)

    @app.post(
        "/wim",
        response_model=WiMResponse,
        responses={200: {"content": {"text/event-stream": {}}}, **API_ERRORS},
    )
    async def wim(body: WiMRequest, caller: Caller) -> Response:
        """Answer a query about a document: one-shot (`context`) or a session (`document_id`)."""
        return await router.answer(body, caller)

    @app.post("/documents", response_model=DocumentResponse, status_code=201, responses=API_ERRORS)
    async def create_document(body: DocumentRequest, caller: Caller) -> DocumentResponse:
        """Read a document once and pin its KV on one engine replica for later queries."""
        return await router.create_document(body, caller)

    @app.get("/documents/{document_id}", response_model=DocumentResponse, responses=API_ERRORS)
    async def get_document(document_id: str, caller: Caller) -> DocumentResponse:
        return await router.get_document(document_id, caller)

    @app.delete("/documents/{document_id}", status_code=204, responses=API_ERRORS)
    async def delete_document(document_id: str, caller: Caller) -> Response:
        """End a document session: its KV is freed and purged from the engine's cache."""
        await router.delete_document(document_id, caller)
        return Response(status_code=204)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz() -> JSONResponse:
        ready = await router.ready_replicas()
        return JSONResponse(
            {"ready": bool(ready), "replicas": ready}, status_code=200 if ready else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text: the WiM metrics and every replica's `vllm:*` metrics."""
        return Response(
            await router.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
