"""The OpenAI-compatible API on the real stack, through the official `openai` client.

Its streams carry the routers' heartbeats (`: keep-alive` comments, `stream_heartbeat_s`, 0.1 s
on this stack) between the engines' events; the client must skip them and still read the
whole answer.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.harness.live_stack import API_KEYS, BASE, MAIN, OPTIONS, LiveStack
from tests.live.test_serving import open_document, serving
from wim_service.serving.http.keepalive import HEARTBEAT

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]

LIVE_APP = MAIN


@pytest.fixture
def client(live_stack: LiveStack) -> Iterator[httpx.Client]:
    yield from serving(live_stack, engines=2)


class Recorded(httpx.HTTPTransport):
    """A transport that keeps every byte of the bodies it receives, as they came."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = b""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        inner, recorder = response.stream, self

        class Tee(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in inner:  # type: ignore[union-attr]
                    recorder.raw += chunk
                    yield chunk

            def close(self) -> None:
                inner.close()  # type: ignore[union-attr]

        response.stream = Tee()
        return response


def test_a_streamed_chat_with_heartbeats_parses_in_the_openai_client(
    client: httpx.Client, report: str
) -> None:
    document = open_document(client, report)
    model = client.get("/v1/models").json()["data"][0]["id"]
    transport = Recorded()
    with httpx.Client(transport=transport, timeout=600) as http:
        sdk = openai.OpenAI(
            base_url=BASE + "/v1", api_key=API_KEYS["alpha"], http_client=http, max_retries=0
        )
        stream = sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the report about?"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=OPTIONS["answer_max_tokens"],
            # The tests' short margins, as the document session was read with.
            extra_body={
                "document_id": document["document_id"],
                "wim": {"margin_max_tokens": OPTIONS["margin_max_tokens"]},
            },
        )
        chunks = list(stream)
    assert HEARTBEAT.encode() in transport.raw  # the client read a stream with heartbeats
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    answer = "".join(d.content or "" for d in deltas)
    assert answer.strip()
    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finished[-1] in ("stop", "length") and finished[:-1] == [None] * (len(finished) - 1)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
