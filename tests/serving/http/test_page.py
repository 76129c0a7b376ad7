"""The reading page at `GET /` in headless Chromium (Debian's `chromium`, driven by playwright):
upload, ask, margins linked to their segments, the streamed answer, cancel, another question on
the same document session. Screenshots go to test-artifacts/ (desktop 1280x800, phone 390x844).

The fast tests serve the real router and app over scripted fake replicas
(tests/fakes/fake_service.py, with an API key configured). `test_page_on_the_real_service`
runs the flow against Ray Serve with real engine replicas (`tests/harness/live_stack.py`,
marker `serving`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.fake_service import API_KEY, LiveService, scripted_job
from tests.harness.live_stack import (
    API_KEYS,
    BASE,
    MAIN,
    LiveStack,
    metric,
    open_client,
    ready_replicas,
    settled,
    wait_for,
)
from tests.harness.pdfs import tiny_pdf
from wim_service.wim.options import WiMOptions

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

ROOT = Path(__file__).parents[3]
ARTIFACTS = ROOT / "test-artifacts"
REPORT = (ROOT / "examples" / "harbor_report.txt").read_text()
# Code points outside the BMP before the report: the server's character offsets count code
# points, JavaScript strings UTF-16 units; the page must still cut the segments right.
DOCUMENT = "Ünïcode préface: 𝐖𝐈𝐌 and 🚢 count once in Python, twice in JavaScript.\n\n" + REPORT
QUESTION = "What is the access code for the night gate?"
SECOND = "Who replaced Margaret Oyelaran?"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SEGMENT_TOKENS = 128


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the browser tests; {reason}")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator:
    executable = _chromium()
    with playwright_sync.sync_playwright() as playwright:
        # Chromium's sandbox needs user namespaces that a root or container session lacks.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def service() -> Iterator[LiveService]:
    with LiveService(delay_s=0.03).running() as live:
        yield live


@pytest.fixture
def page_at(browser) -> Iterator:
    """page_at(base_url, viewport) -> a page on the reading page; fails on any script error."""
    contexts, errors = [], []

    def open_page(base_url: str, viewport: dict[str, int] = DESKTOP):
        context = browser.new_context(viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(error))
        page.goto(base_url + "/")
        return page

    yield open_page
    for context in contexts:
        context.close()
    assert not errors, errors


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=False)


def read_document(page, path: Path, *, key: str | None = API_KEY, timeout_ms: int = 60_000):
    if key is not None:
        page.get_by_text("API key", exact=True).click()
        page.get_by_label("API key, sent as").fill(key)
    page.get_by_label("or open a file").set_input_files(str(path))
    expect(page.get_by_label("Paste plain text or Markdown")).not_to_have_value("")
    page.get_by_label("Segment size (tokens)").fill(str(SEGMENT_TOKENS))
    page.get_by_role("button", name="Read document").click()
    expect(page.locator("#document-status")).to_contain_text("Read in", timeout=timeout_ms)


def ask(page, question: str) -> None:
    page.get_by_label("Question", exact=True).fill(question)
    page.get_by_label("Question", exact=True).press("Enter")


def wait_for_answer(page, timeout_ms: int = 60_000) -> None:
    expect(page.locator("#stats")).to_contain_text("Prompt tokens", timeout=timeout_ms)


@pytest.fixture
def document_file(tmp_path: Path) -> Path:
    path = tmp_path / "harbor report.md"
    path.write_text(DOCUMENT, encoding="utf-8")
    return path


def test_read_ask_cancel_and_ask_again(page_at, service: LiveService, document_file) -> None:
    page = page_at(service.base_url)
    read_document(page, document_file)
    expect(page.get_by_label("Paste plain text or Markdown")).to_be_hidden()

    ask(page, QUESTION)
    wait_for_answer(page)
    events = scripted_job(
        DOCUMENT, QUESTION, WiMOptions(segment_tokens=SEGMENT_TOKENS), segments=False
    )
    margins = [e for e in events if e.type == "margin"]
    kept = [m for m in margins if m.kept]
    assert len(margins) > 5 and kept
    expect(page.locator("#answer")).to_have_text(events[-1].answer)
    expect(page.locator("#margins > li")).to_have_count(len(margins))
    expect(page.locator("#margins > li.kept")).to_have_count(len(kept))
    assert page.locator("#progress").evaluate("p => [p.value, p.max]") == [len(margins)] * 2
    # Each margin's segment is exactly the server's character span of the document.
    for margin in margins:
        segment = page.locator(f"#seg-{margin.segment}")
        assert segment.text_content() == DOCUMENT[margin.char_start : margin.char_end]
    # A kept margin shows the document's words it snapped to, marked in its segment, and
    # the answer's notes hold it.
    for margin in kept:
        item = page.locator(f"#margins > li[data-segment='{margin.segment}']")
        expect(item.locator("blockquote.evidence")).to_have_text(margin.evidence)
        expect(item.locator(".badge")).to_have_text(["kept", "grounded", "in the answer's notes"])
        mark = page.locator(f"#seg-{margin.segment} mark.evidence")
        expect(mark).to_have_text(DOCUMENT[margin.evidence_start : margin.evidence_end])
    # A kept margin points at its segment: hover or keyboard focus highlights it.
    first = kept[0].segment
    item = page.locator(f"#margins > li[data-segment='{first}']")
    item.hover()
    expect(page.locator(f"#seg-{first}")).to_have_class("segment kept highlight")
    page.mouse.move(0, 0)
    expect(page.locator(f"#seg-{first}")).to_have_class("segment kept")
    item.get_by_role("link").focus()
    expect(page.locator(f"#seg-{first}")).to_have_class("segment kept highlight")
    # Dropped margins are collapsed, and say why they were dropped.
    expect(page.locator("#margins > li.dropped details").first).not_to_have_attribute("open", "")
    dropped = [m for m in margins if not m.kept]
    # The script has all three kinds.
    assert {(m.cut_short, m.skipped) for m in dropped} == {
        (True, False),
        (False, True),
        (False, False),
    }
    for margin in margins:
        if not margin.kept:
            reason = (
                "cut short: it named"
                if margin.cut_short
                else "not written: no sentence here"
                if margin.skipped
                else "no note"
            )
            summary = page.locator(f"#margins > li[data-segment='{margin.segment}'] summary")
            expect(summary).to_contain_text(f"Segment {margin.segment + 1}: {reason}")
    expect(page.locator("#stats")).to_contain_text("from the KV cache")
    page.evaluate("window.scrollTo(0, 0)")
    screenshot(page, "page-desktop.png")

    # Cancel: the page aborts its request and the server cancels the job.
    cancelled = service.replica.cancelled
    service.client.delay_s = 0.5
    try:
        ask(page, "What did the harbour police do?")
        expect(page.locator("#margins > li")).not_to_have_count(0, timeout=60_000)
        page.get_by_role("button", name="Cancel").click()
        expect(page.locator("#progress-text")).to_contain_text("Cancelled")
        assert service.wait_for(lambda: service.replica.cancelled == cancelled + 1)
        # It stopped early: fewer margins than the job has segments.
        assert page.locator("#margins > li").count() < len(margins)
    finally:
        service.client.delay_s = 0.03
    status_499 = 'wim_requests_total{status="499"}'
    assert any(line.startswith(status_499) for line in metrics_lines(service.base_url))
    expect(page.get_by_role("button", name="Cancel")).to_be_disabled()

    # Another question on the same document session.
    ask(page, SECOND)
    wait_for_answer(page)
    second = scripted_job(
        DOCUMENT, SECOND, WiMOptions(segment_tokens=SEGMENT_TOKENS), segments=False
    )
    expect(page.locator("#answer")).to_have_text(second[-1].answer)
    # The new answer's marks replace the first's; a kept note the window had no room for
    # says so.
    expect(page.locator("mark.evidence")).to_have_count(
        sum(e.type == "margin" and e.kept for e in second)
    )
    (left_out,) = second[-1].notes_dropped
    expect(page.locator(f"#margins > li[data-segment='{left_out}'] .badge.left-out")).to_have_text(
        "left out: no room in the window"
    )
    expect(page.locator("#history > li")).to_have_count(2)
    expect(page.locator("#history > li").first).to_contain_text(SECOND)
    asked = [args for method, args in service.replica.streams if method == "query_document"]
    (document_id,) = {args[0] for args in asked[-3:]}  # all on one document session
    # Close: the session ends on the server. (Only this one: the module's other tests share
    # the replica, and pytest-randomly may have run one that left its document open.)
    with page.expect_response(lambda r: r.request.method == "DELETE") as closed:
        page.get_by_role("button", name="Close document").click()
    assert closed.value.status == 204, (closed.value.status, closed.value.text())
    expect(page.get_by_label("Paste plain text or Markdown")).to_be_visible()
    assert service.wait_for(lambda: document_id not in service.replica.texts)


def metrics_lines(base_url: str) -> list[str]:
    return httpx.get(base_url + "/metrics").text.splitlines()


def test_phone_width(page_at, service: LiveService, document_file) -> None:
    page = page_at(service.base_url, PHONE)
    read_document(page, document_file)
    ask(page, QUESTION)
    wait_for_answer(page)
    # Nothing wider than the screen; the question comes before the long text.
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    ask_box = page.locator("#reading-panel").bounding_box()
    text_box = page.locator("#document-panel").bounding_box()
    assert ask_box["y"] < text_box["y"]
    page.locator("#answer-heading").scroll_into_view_if_needed()
    screenshot(page, "page-phone.png")


def test_controls_are_labelled_and_reachable_by_keyboard(page_at, service: LiveService) -> None:
    page = page_at(service.base_url)
    unlabelled = page.evaluate(
        """[...document.querySelectorAll('input, select, textarea, progress')]
           .filter(e => !e.labels?.length && !e.getAttribute('aria-labelledby'))
           .map(e => e.id)"""
    )
    assert unlabelled == []
    reached = []
    for _ in range(12):
        page.keyboard.press("Tab")
        reached.append(page.evaluate("document.activeElement.id || document.activeElement.tagName"))
    for target in ("document-text", "document-file", "segment-tokens", "read-button"):
        assert target in reached, reached


def test_a_wrong_key_is_reported(page_at, service: LiveService) -> None:
    page = page_at(service.base_url)
    page.get_by_text("API key", exact=True).click()
    page.get_by_label("API key, sent as").fill("not-the-key")
    page.get_by_label("Paste plain text or Markdown").fill("A short document.")
    page.get_by_role("button", name="Read document").click()
    expect(page.locator("#error")).to_contain_text("HTTP 401")
    # The key lives in this tab's sessionStorage only.
    assert page.evaluate("sessionStorage.getItem('wim.apiKey')") == "not-the-key"
    assert page.evaluate("localStorage.length") == 0


def test_a_pdf_upload_fills_in_its_text(page_at, service: LiveService, tmp_path: Path) -> None:
    path = tmp_path / "gate.pdf"
    path.write_bytes(tiny_pdf("The night gate code is 4417."))
    page = page_at(service.base_url)
    page.get_by_text("API key", exact=True).click()
    page.get_by_label("API key, sent as").fill(API_KEY)
    page.get_by_label("or open a file").set_input_files(str(path))
    expect(page.get_by_label("Paste plain text or Markdown")).to_have_value(
        "The night gate code is 4417."
    )
    refused = httpx.post(
        service.base_url + "/extract/pdf",
        content=b"not a pdf",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/pdf"},
    )
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_input"


# -- the real stack -------------------------------------------------------------------------

LIVE_APP = MAIN


@pytest.fixture
def served_base_url(live_stack: LiveStack) -> str:
    """The real stack (`tests/harness/live_stack.py`): Ray Serve with real engine replicas."""
    live_stack.deploy(MAIN, engines=2)
    with open_client() as client:
        wait_for(lambda: ready_replicas(client), "a ready engine replica")
        wait_for(lambda: settled(client), "no session or reservation left over", timeout=120)
    return BASE


def kv_usage(base_url: str) -> float:
    """The engine replicas' KV cache usage (summed, 0..1 each) as their vLLM metrics say."""
    with open_client() as client:
        return metric(client, "vllm:kv_cache_usage_perc")


@pytest.mark.serving
@pytest.mark.timeout(1800)
def test_page_on_the_real_service(page_at, served_base_url: str, document_file) -> None:
    page = page_at(served_base_url)
    key = API_KEYS["alpha"]
    with page.expect_response(lambda r: r.url.endswith("/documents")) as created:
        read_document(page, document_file, key=key, timeout_ms=300_000)
    document_id = created.value.json()["document_id"]
    try:
        ask_cancel_and_ask_again(page, served_base_url)
        ask_over_the_openai_api(served_base_url, key)
        # Close: the document session ends on the service, its KV reservation with it.
        page.get_by_role("button", name="Close document").click()
        with open_client() as service:
            wait_for(lambda: settled(service), "the closed session's KV returned", timeout=120)
    finally:
        # A failure above must not leave its session to the next real-stack test (they wait
        # for a settled service); 404 once the page has closed it.
        httpx.delete(
            f"{served_base_url}/documents/{document_id}",
            headers={"Authorization": f"Bearer {key}"},
        )


def ask_cancel_and_ask_again(page, base_url: str) -> None:
    segments = int(page.locator("#progress").evaluate("p => p.max"))
    ask(page, QUESTION)
    wait_for_answer(page, timeout_ms=300_000)
    expect(page.locator("#margins > li")).to_have_count(segments)
    assert page.locator("#answer").text_content().strip()
    screenshot(page, "page-desktop-real.png")

    # Cancel mid-job: the engine's KV use returns to what the parked document holds. The
    # page's view of the stream is held (the job may finish on the server within a second:
    # a cached document's margins land at once), so the click always meets a running ask;
    # the click follows the stream's response headers (the router has started the job).
    baseline = kv_usage(base_url)
    hold_next_stream(page)
    with page.expect_response(lambda r: r.url.endswith("/wim")):
        ask(page, SECOND)
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator("#progress-text")).to_contain_text("Cancelled")
    assert "Prompt tokens" not in page.locator("#stats").text_content()
    deadline = time.monotonic() + 60
    while kv_usage(base_url) > baseline and time.monotonic() < deadline:
        time.sleep(1)
    assert kv_usage(base_url) <= baseline

    ask(page, SECOND)
    wait_for_answer(page, timeout_ms=300_000)
    expect(page.locator("#history > li")).to_have_count(2)


# The page's next `/wim` stream, held: its body delivers nothing until the page aborts it.
# The request itself goes out and its abort closes the connection, as without the hold.
HOLD_NEXT_STREAM = """() => {
  const original = window.fetch;
  window.fetch = async (url, init) => {
    const response = await original(url, init);
    if (!String(url).endsWith("/wim")) return response;
    window.fetch = original;
    const held = new ReadableStream({
      start(controller) {
        init.signal.addEventListener("abort", () => {
          controller.error(new DOMException("The user aborted a request.", "AbortError"));
        });
      },
    });
    return new Response(held, { status: response.status, headers: response.headers });
  };
}"""


def hold_next_stream(page) -> None:
    page.evaluate(HOLD_NEXT_STREAM)


def ask_over_the_openai_api(base_url: str, key: str) -> None:
    """The OpenAI API on the same service: WiM over a long prompt, a plain short one."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    wim = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": REPORT}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body={"wim": {"segment_tokens": 192, "margin_max_tokens": 16}},
    )
    assert wim.choices[0].message.content and wim.usage.prompt_tokens_details.cached_tokens > 0
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert plain.choices[0].message.content and plain.usage.completion_tokens <= 8
