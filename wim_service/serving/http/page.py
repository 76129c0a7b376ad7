"""The interactive reading page at `GET /` (static ES modules under `static/`, no build step,
nothing fetched from elsewhere at run time), and the PDF-to-text call it uses for uploads.

The page is public: it holds no data. Every call it makes goes to the authenticated API with
the API key the user typed (`Authorization: Bearer`), kept in the tab's sessionStorage only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from wim_service.serving.errors import ServiceError
from wim_service.serving.http.edge import caller
from wim_service.serving.http.pdf import ExtractedText
from wim_service.serving.tenants import Tenant
from wim_service.wim.errors import ErrorCode

T = TypeVar("T")

STATIC = Path(__file__).parent / "static"
# The page runs only its own files and talks only to this origin.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def install_page(app: FastAPI) -> None:
    """`GET /` and its static files (public)."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


async def _unless_the_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `cancelled` (499) as soon as the client disconnects: then `work` is
    cancelled and awaited, so nothing it started outlives the request. (Serve cancels a request
    whose client left, uvicorn alone does not: this holds under both.)"""

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working, leaving = asyncio.ensure_future(work), asyncio.ensure_future(client_left())
    try:
        await asyncio.wait((working, leaving), return_when=asyncio.FIRST_COMPLETED)
    finally:
        working.cancel()
        leaving.cancel()
        await asyncio.wait((working, leaving))
    if working.cancelled():
        raise ServiceError(ErrorCode.CANCELLED, "the client went away")
    return working.result()


def extract_routes(
    job: Callable[[Tenant], AbstractAsyncContextManager[None]],
    extract: Callable[[bytes], Awaitable[ExtractedText]],
) -> APIRouter:
    """`POST /extract/pdf`: a PDF's text (the request body is the file), `extract(body)` run
    as one of the caller's jobs (`job(tenant)`). Include it behind the app's authentication:
    parsing is work."""
    api = APIRouter(tags=["page"])

    @api.post(
        "/extract/pdf",
        response_model=ExtractedText,
        openapi_extra={
            "requestBody": {"content": {"application/pdf": {}}, "required": True},
        },
    )
    async def extract_pdf(request: Request) -> ExtractedText:
        """The text of a PDF, page by page (for the page's upload), read within the bounds of
        the router's `pdf_*` settings; it counts as one of the tenant's concurrent jobs."""
        data = await request.body()
        if not data.startswith(b"%PDF"):
            raise ServiceError(ErrorCode.INVALID_INPUT, "the body is not a PDF file")
        async with job(caller(request)):
            return await _unless_the_client_leaves(request, extract(data))

    return api
