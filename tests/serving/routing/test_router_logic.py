"""The router's logic over fake engine replicas: HTTP answers, document sessions, option
pinning, placement and failover — no Ray, no engine.

The fakes implement the router's real replica protocol (`serving.replica.protocol`, with the
models of `serving.replica.contracts` and `wim.events`); the router, its HTTP app, placement,
failover and metrics are the real ones.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica, job_events
from tests.fakes.router import UnnoticedDeaths, make_service, metric
from wim_service.engine.config import EngineConfig
from wim_service.placement.state import Work
from wim_service.serving.errors import ServiceError
from wim_service.serving.ingress import build_http_app
from wim_service.serving.replica.contracts import DocumentOpened, ReplicaLoad
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.replica.protocol import NamedReplica, ReplicaProtocol
from wim_service.serving.routing.progress import StreamProgress
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.routing.sizing import JobSizer
from wim_service.wim.events import (
    AnswerEvent,
    DoneEvent,
    ErrorEvent,
    SegmentEvent,
    WiMEvent,
)
from wim_service.wim.options import WiMOptions
from wim_service.wim.plan import check_query, plan_document
from wim_service.wim.prompts import PromptBuilder


def test_the_fakes_implement_the_replica_protocol() -> None:
    """The fakes are replicas of the same protocol as `EngineReplica`: every method, with the
    same parameters, both the fake replica and what its client answers for it."""
    expected = {
        name: inspect.signature(member)
        for name, member in vars(ReplicaProtocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    assert set(expected) >= {"load", "claim", "run", "query_document", "open_document"}
    for fake in (FakeReplica("a"), FakeClient(FakeReplica("a")).replica("a")):
        assert isinstance(fake, ReplicaProtocol)
        for name, signature in expected.items():
            own = inspect.signature(getattr(type(fake), name))
            assert list(own.parameters) == list(signature.parameters), name
            is_async_gen = inspect.isasyncgenfunction(getattr(fake, name))
            assert (
                is_async_gen
                or inspect.iscoroutinefunction(getattr(fake, name))
                or (name in ("run", "complete", "query_document"))
            ), name


async def test_a_typed_call_reaches_the_method_of_its_name() -> None:
    replica = FakeReplica("a")
    client = FakeClient(replica)
    remote = client.replica("a")
    assert (await remote.load()).replica == "a"
    opened = await remote.open_document("d", DOCUMENT, WiMOptions())
    assert isinstance(opened, DocumentOpened)
    assert await remote.claim(["d"], 1.0) == 1
    assert [e.type async for e in remote.query_document("d", "q?", WiMOptions())][-1] == "done"
    assert await remote.metrics_text() == await replica.metrics_text()
    assert await remote.close_document("d") is True
    assert replica.calls == [
        "load",
        "open_document",
        "claim",
        "query_document",
        "metrics_text",
        "close_document",
    ]


async def test_a_named_replica_sends_each_call_by_its_own_name() -> None:
    """`NamedReplica` turns each typed call into a call by name to its replica (what a Serve
    handle takes), with the call's arguments, and answers what came back."""
    sent: list[tuple[str, str, tuple[Any, ...]]] = []

    class Recorded:
        async def call(self, replica: str, method: str, *args: Any) -> Any:
            sent.append((replica, method, args))
            return method

        async def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
            sent.append((replica, method, args))
            yield AnswerEvent(text=method)

    remote = NamedReplica(Recorded(), "a")
    options, params = WiMOptions(), PlainParams(max_tokens=4, cache_salt="t")
    assert await remote.load() == "load"
    assert await remote.claim(["d"], 1.0) == "claim"
    assert await remote.metrics_text() == "metrics_text"
    assert await remote.open_document("d", "text", options, "t", True) == "open_document"
    assert await remote.close_document("d") == "close_document"
    assert [e async for e in remote.run("text", "q?", options)] == [AnswerEvent(text="run")]
    assert [e async for e in remote.complete([1, 2], params)] == [AnswerEvent(text="complete")]
    queried = [e async for e in remote.query_document("d", "q?", options)]
    assert queried == [AnswerEvent(text="query_document")]
    assert sent == [
        ("a", "load", ()),
        ("a", "claim", (["d"], 1.0)),
        ("a", "metrics_text", ()),
        ("a", "open_document", ("d", "text", options, "t", True)),
        ("a", "close_document", ("d",)),
        ("a", "run", ("text", "q?", options)),
        ("a", "complete", ([1, 2], params)),
        ("a", "query_document", ("d", "q?", options)),
    ]


def test_one_shot_job_answers_with_margins_and_unbinds() -> None:
    client, router = make_service(FakeReplica("a"))
    response = client.post("/wim", json={"context": DOCUMENT, "query": "code?"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"] == "The code is 4417." and body["replica"] == "a"
    assert [m["segment"] for m in body["margins"]] == [0, 1, 2]
    assert [m["relevant"] for m in body["margins"]] == [False, True, False]
    assert router.fleet.ledger.bindings == {}  # the job's binding ended with it
    assert metric(client, "wim_requests_total", status="200") == 1
    assert metric(client, "wim_margins_total", relevant="true") == 1
    assert metric(client, "wim_prefix_cache_hit_tokens_total") == 7
    assert metric(client, "vllm:num_requests_running", replica="a") == 0


def test_document_session_is_pinned_and_deleted() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    client, _ = make_service(a, b)
    opened = client.post("/documents", json={"context": DOCUMENT})
    assert opened.status_code == 201, opened.text
    document = opened.json()
    home = {"a": a, "b": b}[document["replica"]]
    for _ in range(3):
        answer = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
        assert answer.status_code == 200 and answer.json()["replica"] == home.name
    assert home.calls.count("query_document") == 3
    assert client.get(f"/documents/{document['document_id']}").json()["replica"] == home.name
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
    assert home.documents == {}
    gone = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
    assert gone.status_code == 404 and gone.json()["code"] == "not_found"
    assert metric(client, "wim_session_binding_total", result="hit") == 3


def test_a_query_may_not_change_options_fixed_at_upload() -> None:
    client, _ = make_service(FakeReplica("a"))
    document = client.post(
        "/documents", json={"context": DOCUMENT, "options": {"segment_tokens": 256}}
    ).json()
    same = {"document_id": document["document_id"], "query": "q"}
    changed = client.post("/wim", json={**same, "options": {"segment_tokens": 128}})
    assert changed.status_code == 422 and "segment_tokens" in changed.json()["message"]
    prompt = client.post("/wim", json={**same, "options": {"prompts": {"system": "Be brief."}}})
    assert prompt.status_code == 422 and "prompts.system" in prompt.json()["message"]
    # Per-query options and the same fixed value are fine.
    fine = client.post(
        "/wim", json={**same, "options": {"segment_tokens": 256, "answer_max_tokens": 8}}
    )
    assert fine.status_code == 200, fine.text
    # Every option that would change is named, and the client is told what to do instead.
    both = client.post(
        "/wim", json={**same, "options": {"segment_tokens": 128, "prompts": {"system": "Hi."}}}
    )
    assert both.status_code == 422
    assert both.json()["message"] == (
        "segment_tokens, prompts.system were fixed when the document was read; "
        "upload the document again to change them"
    )


def test_full_replicas_answer_429_and_no_replica_503() -> None:
    client, _ = make_service(FakeReplica("a", capacity=1))
    full = client.post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert full.status_code == 429 and full.json()["code"] == "overloaded"
    assert int(full.headers["Retry-After"]) >= 1
    assert metric(client, "wim_session_binding_total", result="rejected") == 1
    assert metric(client, "wim_requests_total", status="429") == 1
    nobody, _ = make_service()
    none = nobody.post("/documents", json={"context": DOCUMENT})
    assert none.status_code == 503 and none.headers["Retry-After"]


async def test_work_is_refused_on_fresh_loads_only() -> None:
    """A replica that reported itself full at the last poll and has room now takes the work:
    the router asks the loads again before it refuses (429)."""
    a = FakeReplica("a", capacity=100)
    router = WiMRouter(
        None, {"router": {"replica_wait_s": 0}}, client=FakeClient(a), http_host="::1"
    )
    a.reserved = a.capacity
    await router.fleet.refresh_loads()  # the last poll: a was full then
    a.reserved = 0  # ... and has room now
    booking = await router.fleet.place(
        "job", Work(prompt_tokens=100, answer_tokens=8, kv_blocks=60)
    )
    assert booking.replica == "a" and router.fleet.ledger.loads["a"].reserved_blocks == 60
    assert a.calls.count("load") == 2
    router.shutdown()


def test_sessions_go_to_the_replica_with_most_room_under_sticky() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b", capacity=10_000)
    client, _ = make_service(a, b, placement="sticky")
    replicas = [
        client.post("/documents", json={"context": DOCUMENT}).json()["replica"] for _ in range(2)
    ]
    assert replicas == ["a", "a"]


def test_sessions_go_where_they_start_soonest_under_expected_wait() -> None:
    """The default `expected_wait` placement weighs the work queued on each replica, not its
    free KV: new documents go to the idle replica, however little KV it has left."""
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b", capacity=10_000)
    a.backlog_s = 30.0
    client, _ = make_service(a, b, placement="expected_wait")
    replicas = [
        client.post("/documents", json={"context": DOCUMENT}).json()["replica"] for _ in range(2)
    ]
    assert replicas == ["b", "b"]


async def test_a_replica_that_does_not_answer_holds_back_no_other_replicas_report() -> None:
    """A node that is gone leaves its replica's load call hanging (until LOAD_TIMEOUT_S): a
    poll takes the others' reports within POLL_WAIT_S meanwhile, keeps the silent replica's
    last one, and asks it once, not once more per poll."""
    from wim_service.serving.routing.fleet import POLL_WAIT_S

    a, b = FakeReplica("a"), FakeReplica("b")
    router = WiMRouter(None, {"router": {}}, client=UnnoticedDeaths(a, b), http_host="::1")
    await router.fleet.refresh_loads()
    answer = asyncio.Event()
    load = a.load

    async def silent() -> ReplicaLoad:
        await answer.wait()
        return await load()

    a.load = silent  # type: ignore[method-assign]
    b.reserved = a.reserved = 7
    loop = asyncio.get_running_loop()
    for _ in range(2):
        started = loop.time()
        await router.fleet.refresh_loads()
        assert loop.time() - started < POLL_WAIT_S + 0.5
        loads = router.fleet.ledger.loads
        assert (loads["a"].reserved_blocks, loads["b"].reserved_blocks) == (0, 7)
    assert a.calls.count("load") == 2  # the first poll's, then the one still waiting
    answer.set()
    await router.fleet.refresh_loads()
    assert router.fleet.ledger.loads["a"].reserved_blocks == 7
    router.shutdown()


async def test_a_router_says_when_its_cost_profile_is_not_of_its_engines_dtype(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The shipped profile was measured in bfloat16: engines that report float32 are slower
    than it says, and the router logs so once when it learns their loads; engines of the
    profile's dtype log nothing."""
    float32, bf16 = FakeReplica("a"), FakeReplica("b")
    float32.dtype = "float32"
    router = WiMRouter(None, {"router": {}}, client=FakeClient(float32, bf16), http_host="::1")
    with caplog.at_level(logging.WARNING, logger="wim_service.serving.routing.fleet"):
        for _ in range(2):
            await router.fleet.refresh_loads()
    warnings = [r.getMessage() for r in caplog.records if "cost_profile" in r.getMessage()]
    (warning,) = warnings
    assert "measured in bfloat16, the engines run float32 (replica a)" in warning
    router.shutdown()


class ScriptedClient(FakeClient):
    """Streams `events` for every job instead of a whole one."""

    def __init__(self, events: list[WiMEvent], *replicas: FakeReplica) -> None:
        super().__init__(*replicas)
        self.events = events

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        for event in self.events:
            yield event.model_copy()


def scripted(*events: WiMEvent) -> TestClient:
    client = ScriptedClient(list(events), FakeReplica("a"))
    router = WiMRouter(
        None, {"router": {"replica_wait_s": 0}}, client=client, http_host="127.0.0.1"
    )
    return TestClient(build_http_app(router))


def test_a_job_failing_after_its_first_event_answers_with_the_errors_status() -> None:
    first = job_events()[0]
    overloaded = ErrorEvent(code="overloaded", message="KV ran out", retry_after_s=2.5)
    response = scripted(first, overloaded).post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert response.status_code == 429
    assert response.json() == {"code": "overloaded", "message": "KV ran out"}
    assert response.headers["Retry-After"] == "3"
    ended = scripted(first, job_events()[1]).post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert ended.status_code == 502
    assert ended.json() == {"code": "engine_error", "message": "the job ended without an answer"}


def test_the_answer_names_the_notes_the_final_prompt_held_and_dropped() -> None:
    done = job_events()[-1]
    assert isinstance(done, DoneEvent)
    done.notes, done.notes_dropped = [1, 2], [0]
    client = scripted(*job_events()[:-1], done)
    body = client.post("/wim", json={"context": DOCUMENT, "query": "q"}).json()
    assert (body["notes"], body["notes_dropped"]) == ([1, 2], [0])


def test_a_streamed_answer_is_uncached_server_sent_events() -> None:
    client, _ = make_service(FakeReplica("a"))
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    body = {"document_id": document_id, "query": "q", "stream": True}
    with client.stream("POST", "/wim", json=body) as response:
        text = "".join(response.iter_text())
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["X-Accel-Buffering"] == "no"  # nginx passes each event on at once
    events = [(k, json.loads(d)) for k, d in re.findall(r"event: (\w+)\ndata: (.*)\n\n", text)]
    assert [k for k, _ in events] == [e.type for e in job_events()]
    assert all("type" not in data for _, data in events)  # the event name says it
    _, done = events[-1]
    assert (done["session_id"], done["replica"]) == (document_id, "a")


def test_stream_progress_trims_what_an_earlier_attempt_sent() -> None:
    progress = StreamProgress()
    assert progress.fresh(AnswerEvent(text="The co"))
    progress.new_attempt()
    again = AnswerEvent(text="The code")
    assert progress.fresh(again) and again.text == "de"
    assert not progress.fresh(AnswerEvent(text=""))
    segment = SegmentEvent(
        segment=0, segments=1, tokens=1, context_tokens=1, char_start=0, char_end=1
    )
    assert progress.fresh(segment) and not progress.fresh(segment.model_copy())


def test_a_router_loads_its_tokenizer_before_its_first_request() -> None:
    """The first request after a router started waited ~7 s for the tokenizer and sentence
    splitter (compare_sim's first POST /documents: 5.5-7.2 s in the router, 30 ms later)."""
    from wim_service.serving.routing import sizing

    sizing._tokenizer.cache_clear()
    make_service(FakeReplica("a"))
    assert sizing._tokenizer.cache_info().currsize == 1


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/docs", "/openapi.json"])
def test_service_endpoints_answer(path: str) -> None:
    client, _ = make_service(FakeReplica("a"))
    response = client.get(path)
    assert response.status_code == 200
    if path == "/readyz":
        assert response.json() == {"ready": True, "replicas": ["a"]}


def test_readyz_without_replicas_is_503() -> None:
    client, _ = make_service()
    response = client.get("/readyz")
    assert response.status_code == 503 and response.json()["ready"] is False


def test_each_pinned_call_gets_its_own_serve_request_id() -> None:
    """Serve matches a routed replica back to its pending call by the internal request id;
    calls made from one request must not share it (they were crossed or left waiting)."""
    from ray.serve.context import _get_serve_request_context, _set_request_context

    from wim_service.serving.replica.client import ServeReplicaClient

    seen: list[tuple[str, str]] = []

    class Handle:
        def options(self, **kwargs: Any) -> Handle:
            self.session = kwargs["session_id"]
            return self

        def remote(self, *args: Any) -> Any:
            seen.append((self.session, _get_serve_request_context()._internal_request_id))

            async def answer() -> str:
                return "ok"

            return answer()

    async def calls() -> None:
        _set_request_context(request_id="outer", _internal_request_id="outer-internal")
        client = ServeReplicaClient(Handle())
        await asyncio.gather(*(client.call(r, "load") for r in ("a", "b", "c")))
        assert _get_serve_request_context()._internal_request_id == "outer-internal"

    asyncio.run(calls())
    ids = [internal for _, internal in seen]
    assert len(set(ids)) == 3 and "outer-internal" not in ids


def test_a_stream_to_a_replica_gone_before_the_call_is_lost_not_failed() -> None:
    """Serve's `cancel()` of a call that failed raises the call's failure again; the stream's
    cleanup must not turn the ReplicaLost (fail over) into another error (an engine error,
    seen when an engine node was killed with queries in flight:
    tests/multinode/test_multinode.py)."""
    from wim_service.serving.replica.client import ReplicaLost, ServeReplicaClient
    from wim_service.serving.replica.pinning import ReplicaGone

    class Response:
        def __aiter__(self) -> Response:
            return self

        async def __anext__(self) -> Any:
            raise ReplicaGone("engine replica r1 is no longer serving")

        def cancel(self) -> None:
            raise ReplicaGone("engine replica r1 is no longer serving")

    class Handle:
        def options(self, **kwargs: Any) -> Handle:
            return self

        def remote(self, *args: Any) -> Response:
            return Response()

    async def stream() -> None:
        client = ServeReplicaClient(Handle())
        with pytest.raises(ReplicaLost):
            async for _ in client.stream("r1", "query_document"):
                pass
        assert client.in_flight == {"r1": 0}

    asyncio.run(stream())


async def test_the_sizer_sizes_sessions_and_jobs_and_refuses_with_the_errors_status() -> None:
    sizer = JobSizer(EngineConfig(max_model_len=1024))
    options = WiMOptions(segment_tokens=128)
    builder = PromptBuilder(sizer.tokenizer, options.prompts)
    plan = plan_document(builder, DOCUMENT, options, sizer.limits)
    block, window = sizer.limits.block_size, sizer.limits.max_model_len
    session = plan.shape(builder, options, None).session_blocks(block, window)
    job = check_query(plan, builder, sizer.limits, "q?", options).one_shot_blocks(block, window)
    assert sizer.blocks(await sizer.shape(DOCUMENT, options, None), one_shot=False) == session
    assert sizer.blocks(await sizer.shape(DOCUMENT, options, "q?"), one_shot=True) == job
    with pytest.raises(ServiceError) as refused:
        await sizer.shape(DOCUMENT * 40, options, "q?")
    assert (refused.value.code, refused.value.status) == ("too_long", 413)
    assert refused.value.message.startswith("the document is ")
    assert refused.value.retry_after is None
