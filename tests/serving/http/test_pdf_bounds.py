"""`POST /extract/pdf` on hostile PDFs (serving/http/pdf.py): each is refused with a 4xx in the
error table's shape and a message of ours (no pypdf text, no traceback), within the deadline
(pytest-timeout: the deadline plus a margin for a busy machine), and leaves no worker process
behind; a normal PDF still reads afterwards. An extraction holds one of the tenant's concurrent
jobs; a client that leaves, and a router that shuts down, take the worker with them.

The app runs on fake replicas (tests/fakes/fake_service.py): no engine, no Ray.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.fakes.fake_service import API_KEY, LiveService
from tests.fakes.replicas import FakeClient, FakeReplica
from tests.harness.pdfs import HELVETICA, pages_pdf, pdf_file, shown, stream, tiny_pdf
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.http.pdf import WORKER, WORKER_ENV, ExtractedText, PdfExtractor
from wim_service.serving.ingress import build_http_app
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import TenantLimits

DEADLINE_S = RouterConfig().pdf_timeout_s
MAX_PAGES = RouterConfig().pdf_max_pages
MARGIN_S = 15  # a worker starts in about a second; more on a busy machine
# The tight service: the least memory, little text, one job at a time, a short deadline.
TIGHT_CHARS = 2000
TIGHT_DEADLINE_S = 5  # a normal or a memory-capped read takes under 0.5 s at load 4.5
TIGHT = {
    "pdf_max_memory_bytes": 128 * 2**20,
    "max_document_chars": TIGHT_CHARS,
    "pdf_timeout_s": TIGHT_DEADLINE_S,
}
# 250,000 text operators in one content stream (34 kB deflated): pypdf gives up past its
# budget of 2,000,000 tokens per stream (LimitReachedError), after 8 s on an idle core.
HUGE_CONTENT = shown("page text here") * 250_000
# 400 pages (under the cap) sharing a stream of 20,000 empty text operators: about a second
# of pypdf's time per page, each page under its token budget and none with text, so only
# the deadline ends it: several minutes of work, on any machine, where HUGE_CONTENT ends
# by itself sooner on a fast one.
ENDLESS = pages_pdf(400, shown("") * 20_000, compress=True)
NORMAL = "The night gate code is 4417."
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/pdf"}


@pytest.fixture(scope="module")
def service() -> Iterator[LiveService]:
    """The default bounds."""
    with LiveService().running() as live:
        yield live


@pytest.fixture(scope="module")
def tight() -> Iterator[LiveService]:
    with LiveService(TIGHT, limits=TenantLimits(concurrent_jobs=1)).running() as live:
        yield live


def workers() -> list[psutil.Process]:
    """The PDF workers among this process's children (the app runs in a thread of it)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER in child.cmdline():
                found.append(child)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def extract(live: LiveService, pdf: bytes) -> httpx.Response:
    return httpx.post(live.base_url + "/extract/pdf", content=pdf, headers=HEADERS, timeout=120)


def assert_refused(response: httpx.Response, status: int, code: str, message: str) -> None:
    """A refusal in the error table's shape with exactly our `message`, and no worker left."""
    assert response.status_code == status, response.text
    assert response.json() == {"code": code, "message": message}
    assert not workers()


def assert_reads(live: LiveService) -> None:
    response = extract(live, tiny_pdf(NORMAL))
    assert response.status_code == 200, response.text
    assert response.json() == {"text": NORMAL, "pages": 1}
    assert not workers()


@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_20000_pages_sharing_one_huge_content_stream_are_refused_by_their_count(
    service: LiveService,
) -> None:
    # 3.2 MB: pypdf walks the page tree for seconds, then spends a minute on the first page.
    pdf = pages_pdf(20_000, HUGE_CONTENT, compress=True)
    assert_refused(
        extract(service, pdf),
        413,
        "too_long",
        f"the PDF has 20000 pages; this service reads at most {MAX_PAGES}",
    )
    assert_reads(service)


@pytest.mark.parametrize("declared", [MAX_PAGES + 1, 1], ids=["declared", "understated"])
@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_more_pages_than_the_cap_are_refused(service: LiveService, declared: int) -> None:
    pdf = pages_pdf(MAX_PAGES + 1, shown("a page"), count=declared)
    assert_refused(
        extract(service, pdf),
        413,
        "too_long",
        f"the PDF has {MAX_PAGES + 1} pages; this service reads at most {MAX_PAGES}",
    )
    assert_reads(service)


def parent_cycle() -> bytes:
    """A page inheriting its resources from a parent that is its own parent: pypdf raises
    `LimitReachedError`, which is no `PdfReadError`."""
    return pdf_file(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [5 0 R] /Count 1 >>",
            stream(shown(NORMAL)),
            HELVETICA,
            b"<< /Type /Page /Parent 6 0 R /MediaBox [0 0 612 792] /Contents 3 0 R >>",
            b"<< /Parent 6 0 R >>",
        ]
    )


@pytest.mark.parametrize(
    "pdf",
    [
        b"%PDF-1.7\n" + bytes(range(256)) * 40,
        tiny_pdf(NORMAL)[:300],
        parent_cycle(),
    ],
    ids=["garbage", "truncated", "parent-cycle"],
)
@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_an_unreadable_pdf_gets_a_fixed_message(service: LiveService, pdf: bytes) -> None:
    assert_refused(extract(service, pdf), 400, "invalid_input", "not a readable PDF")
    assert_reads(service)


@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_a_pdf_that_reads_past_the_deadline_is_stopped_there(tight: LiveService) -> None:
    assert_refused(
        extract(tight, ENDLESS),
        422,
        "too_complex",
        f"reading this PDF took longer than {TIGHT_DEADLINE_S:g} s, the most this service gives it",
    )
    assert_reads(tight)


@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_a_stream_that_inflates_past_the_memory_limit_is_refused(tight: LiveService) -> None:
    # 40 kB that inflate to a 40 MB string; reading it needs several times that.
    pdf = pages_pdf(1, shown("A" * 40_000_000), compress=True)
    assert_refused(
        extract(tight, pdf),
        422,
        "too_complex",
        "reading this PDF needs more than 128 MiB, the most this service gives it",
    )
    assert_reads(tight)


@pytest.mark.timeout(DEADLINE_S + MARGIN_S, func_only=True)
def test_more_text_than_the_service_takes_is_refused(tight: LiveService) -> None:
    pdf = pages_pdf(3, shown("x" * (TIGHT_CHARS // 2)))
    assert_refused(
        extract(tight, pdf),
        413,
        "too_long",
        f"the PDF's text is longer than {TIGHT_CHARS} characters, the most this service takes",
    )
    assert_reads(tight)


@pytest.mark.timeout(2 * (TIGHT_DEADLINE_S + MARGIN_S), func_only=True)
def test_an_extraction_holds_one_of_the_tenants_concurrent_jobs(tight: LiveService) -> None:
    slow: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: slow.append(extract(tight, ENDLESS)))
    holder.start()
    while not workers():
        time.sleep(0.02)
    refused = extract(tight, tiny_pdf(NORMAL))
    assert refused.status_code == 429, refused.text
    assert refused.json()["code"] == "rate_limited" and refused.headers["Retry-After"]
    holder.join()
    assert slow[0].status_code == 422, slow[0].text
    assert_reads(tight)  # the job is given back


@pytest.mark.timeout(DEADLINE_S - 2, func_only=True)  # before the deadline would stop it
def test_a_client_that_leaves_takes_its_worker_with_it(service: LiveService) -> None:
    pdf = ENDLESS
    head = (
        f"POST /extract/pdf HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/pdf\r\nContent-Length: {len(pdf)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", service.port)) as client:
        client.sendall(head.encode() + pdf)
        while not workers():
            time.sleep(0.02)
    while workers():
        time.sleep(0.02)
    assert_reads(service)


@pytest.mark.timeout(DEADLINE_S - 2, func_only=True)
async def test_a_router_that_shuts_down_kills_its_workers() -> None:
    router = WiMRouter(None, {}, client=FakeClient(FakeReplica("a")), http_host="127.0.0.1")
    app = build_http_app(router)
    async with app.router.lifespan_context(app):  # as Serve runs it around a router replica
        extraction = asyncio.ensure_future(router.pdf.extract(ENDLESS))
        while not workers():
            await asyncio.sleep(0.02)
    with pytest.raises(ServiceError) as refused:
        await extraction
    assert (refused.value.status, refused.value.code) == (503, "unavailable")
    assert not workers()
    with pytest.raises(ServiceError, match="shutting down"):  # and it starts no new one
        await router.pdf.extract(tiny_pdf(NORMAL))


# The reads below are ended by the test, never by the deadline (far off, on a busy machine).
LONG_DEADLINE = RouterConfig(pdf_timeout_s=600)


@pytest.mark.timeout(2 * MARGIN_S, func_only=True)
async def test_a_pdf_worker_gets_none_of_the_routers_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker parses what a client sent: it sees the environment `WORKER_ENV` names, and no
    API key, Redis password or store key of the router's."""
    secrets = {
        "WIM_API_KEYS": "acme:sk-router-secret",
        "WIM_REDIS_URL": "redis://:redis-secret@127.0.0.1:6379/0",
        "WIM_STORE_ENCRYPTION_KEY": "c3RvcmUtc2VjcmV0",
        "AWS_SECRET_ACCESS_KEY": "cloud-secret",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    extractor = PdfExtractor(LONG_DEADLINE)
    extraction = asyncio.ensure_future(extractor.extract(ENDLESS))
    while not (running := workers()):
        await asyncio.sleep(0.02)
    environment = running[0].environ()
    extractor.close()
    with pytest.raises(ServiceError):
        await extraction
    assert set(environment) <= set(WORKER_ENV), sorted(set(environment) - set(WORKER_ENV))
    for value in secrets.values():
        assert all(value not in seen for seen in environment.values())
    assert not workers()


@pytest.mark.timeout(2 * MARGIN_S, func_only=True)
async def test_a_router_runs_at_most_pdf_max_workers_at_once() -> None:
    """Over all tenants: one more upload is refused at once, 429 with Retry-After, and none
    of its worker starts; once a worker ends, its place is free again."""
    extractor = PdfExtractor(LONG_DEADLINE.model_copy(update={"pdf_max_workers": 1}))
    extraction = asyncio.ensure_future(extractor.extract(ENDLESS))
    while not workers():
        await asyncio.sleep(0.02)
    with pytest.raises(ServiceError) as refused:
        await extractor.extract(tiny_pdf(NORMAL))
    failure = refused.value
    assert (failure.status, failure.code, failure.retry_after) == (429, "overloaded", 5)
    assert len(workers()) == 1
    extraction.cancel()  # the client went away: its worker is killed, its place freed
    with pytest.raises(asyncio.CancelledError):
        await extraction
    assert await extractor.extract(tiny_pdf(NORMAL)) == ExtractedText(text=NORMAL, pages=1)
    assert not workers()
