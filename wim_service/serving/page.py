"""The interactive reading page at `GET /` (static ES modules under `static/`, no build step,
nothing fetched from elsewhere at run time), and the PDF-to-text call it uses for uploads.

The page is public: it holds no data. Every call it makes goes to the authenticated API with
the API key the user typed (`Authorization: Bearer`), kept in the tab's sessionStorage only.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from wim_service.serving.errors import HTTPFailure
from wim_service.wim.errors import ErrorCode

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


class ExtractedText(BaseModel):
    text: str
    pages: int


def pdf_text(data: bytes) -> ExtractedText:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PdfReadError, ValueError, KeyError) as exc:
        raise HTTPFailure(ErrorCode.INVALID_INPUT, f"not a readable PDF: {exc}") from exc
    return ExtractedText(text="\n\n".join(p.strip() for p in pages).strip(), pages=len(pages))


def extract_routes() -> APIRouter:
    """`POST /extract/pdf`: a PDF's text (the request body is the file). Include it behind
    the app's authentication: parsing is work."""
    api = APIRouter(tags=["page"])

    @api.post(
        "/extract/pdf",
        response_model=ExtractedText,
        openapi_extra={
            "requestBody": {"content": {"application/pdf": {}}, "required": True},
        },
    )
    async def extract_pdf(request: Request) -> ExtractedText:
        """The text of a PDF, page by page (for the page's upload)."""
        data = await request.body()
        if not data.startswith(b"%PDF"):
            raise HTTPFailure(ErrorCode.INVALID_INPUT, "the body is not a PDF file")
        return await asyncio.to_thread(pdf_text, data)

    return api
