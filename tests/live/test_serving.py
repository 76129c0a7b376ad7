"""The service end to end: local Ray Serve, two real vLLM engine replicas, real HTTP.

Every test starts from the same state, whatever ran before it (the `client` fixture): two
ready engine replicas, no document session, no KV reserved; the tests that scale up from one
replica start from one (`one_engine_client`). Tests wait on conditions (events seen, metrics
moved), not on clocks. Those that kill or scale replicas are marked `replica_step(n)`: they
run last, in an order where each one that leaves a replica short is followed by one that
starts from one replica (`tests/conftest.py`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.harness.live_stack import (
    BASE,
    MAIN,
    OPTIONS,
    QUERY,
    LiveStack,
    auth,
    from_pinned_kv,
    metric,
    open_client,
    parse_sse,
    query_body,
    ready_replicas,
    session_logs,
    settled,
    wait_for,
)

# Real engines start and move in minutes on a busy 2-core machine.
pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]

LIVE_APP = MAIN
MAINTENANCE = "wim_maintenance_failures_total"
MARKER = "Zebulon Quartermaine hid the brass key under the ninth flagstone."


def serving(live_stack: LiveStack, engines: int) -> Iterator[httpx.Client]:
    """`engines` ready replicas, nothing left over from an earlier test."""
    live_stack.deploy(MAIN, engines=engines)
    wait_for(lambda: live_stack.engines_settled(engines), f"Serve to run {engines} engines only")
    with open_client() as service:
        wait_for(lambda: len(ready_replicas(service)) == engines, f"{engines} ready replicas")
        wait_for(lambda: settled(service), "no session or reservation left over", timeout=120)
        yield service


@pytest.fixture
def client(live_stack: LiveStack) -> Iterator[httpx.Client]:
    yield from serving(live_stack, engines=2)


@pytest.fixture
def one_engine_client(live_stack: LiveStack) -> Iterator[httpx.Client]:
    """For tests that scale up from one replica: a replacement still starting after an
    earlier test's kill is stopped, not waited for."""
    yield from serving(live_stack, engines=1)


def open_document(client: httpx.Client, text: str) -> dict:
    response = client.post("/documents", json={"context": text, "options": OPTIONS})
    assert response.status_code == 201, response.text
    return response.json()


class Stream:
    """A streamed POST /wim in a thread: events as they arrive, and the final status."""

    def __init__(self, body: dict) -> None:
        self.events: list[tuple[str, dict]] = []
        self.status = 0
        self._text = ""
        self._thread = threading.Thread(target=self._run, args=(body,))
        self._thread.start()

    def _run(self, body: dict) -> None:
        with (
            httpx.Client(base_url=BASE, timeout=900, headers=auth()) as c,
            c.stream("POST", "/wim", json={**body, "stream": True}) as response,
        ):
            self.status = response.status_code
            for chunk in response.iter_text():
                self._text += chunk
                self.events = parse_sse(self._text)

    def wait_for_event(self, kind: str) -> dict:
        wait_for(lambda: [d for k, d in self.events if k == kind], f"a {kind} event", 600)
        return next(d for k, d in self.events if k == kind)

    def join(self) -> list[tuple[str, dict]]:
        self._thread.join(900)
        return parse_sse(self._text)


def test_one_shot_job_over_http(client: httpx.Client, report: str) -> None:
    options = {**OPTIONS, "answer_max_tokens": 48}  # room for the whole sentence with the code
    response = client.post("/wim", json={"context": report, "query": QUERY, "options": options})
    assert response.status_code == 200, response.text
    body = response.json()
    assert "4417" in body["answer"], body["answer"]
    assert body["replica"] and body["session_id"].startswith("job-")
    assert [m["segment"] for m in body["margins"]] == list(range(body["usage"]["segments"]))
    assert body["usage"]["prompt_tokens_cached"] > 0
    assert response.headers["X-Request-ID"]


def test_document_session_is_pinned_and_reuses_its_kv(client: httpx.Client, report) -> None:
    hits = metric(client, "wim_session_binding_total", result="hit")
    document = open_document(client, report)
    assert document["context_tokens"] > 1000 and document["segments"] >= 5
    wait_for(
        lambda: metric(client, "wim_session_resident_kv_tokens") >= document["context_tokens"],
        "the session's resident KV tokens in /metrics",
    )
    replicas = set()
    for query in (QUERY, "Who replaced Margaret Oyelaran?", "How many boats are registered?"):
        asked = {"document_id": document["document_id"], "query": query, "options": OPTIONS}
        response = client.post("/wim", json=asked)
        assert response.status_code == 200, response.text
        body = response.json()
        replicas.add(body["replica"])
        usage = body["usage"]
        # The document is not prefilled again: only margin/final instructions and the partial
        # blocks at segment ends are computed.
        assert usage["prompt_tokens_computed"] - usage["minimal_prompt_tokens"] < 32 * 8
        assert from_pinned_kv(body, document)
    assert replicas == {document["replica"]}
    assert metric(client, "wim_session_binding_total", result="hit") == hits + 3
    assert client.get(f"/documents/{document['document_id']}").json()["replica"] in replicas
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
    gone = client.post("/wim", json={"document_id": document["document_id"], "query": QUERY})
    assert gone.status_code == 404 and gone.json()["code"] == "not_found"


def test_a_hot_document_is_copied_to_the_second_replica_and_both_answer(
    client: httpx.Client, report: str
) -> None:
    """`placement: expected_wait` (the default): queries at once on one document make
    its replica busier than reading a copy on the other; both then answer its queries, and
    DELETE closes both copies."""
    opened = metric(client, "wim_document_copies_opened_total")
    on_copies = metric(client, "wim_copy_queries_total", role="copy")
    document = open_document(client, report)
    # Room for the whole sentence with the code (a per-query option).
    body = {**query_body(document["document_id"]), "options": {**OPTIONS, "answer_max_tokens": 48}}

    def ask(_: int) -> httpx.Response:
        with open_client() as own:
            return own.post("/wim", json=body)

    with ThreadPoolExecutor(4) as clients:
        answers = list(clients.map(ask, range(8)))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert "4417" in answer.json()["answer"], answer.json()["answer"]
    replicas = {answer.json()["replica"] for answer in answers}
    assert len(replicas) == 2, replicas
    assert metric(client, "wim_document_copies_opened_total") == opened + 1
    assert metric(client, "wim_copy_queries_total", role="copy") > on_copies
    for replica in replicas:
        wait_for(
            lambda r=replica: metric(client, "wim_sessions_active", replica=r) == 1,
            f"the document's session on {replica}",
        )
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
    # Every copy closed: no session and no KV reserved on either replica.
    wait_for(lambda: settled(client), "both copies closed", timeout=120)


def test_sse_streams_events_in_order(client: httpx.Client, report: str) -> None:
    body = {"context": report, "query": QUERY, "options": OPTIONS, "stream": True}
    with client.stream("POST", "/wim", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    kinds = [k for k, _ in events]
    assert kinds[0] == "segment" and kinds[-1] == "done"
    assert kinds.index("answer") > max(i for i, k in enumerate(kinds) if k == "margin")
    assert max(i for i, k in enumerate(kinds) if k == "segment") < kinds.index("answer")
    done = events[-1][1]
    answer = "".join(d["text"] for k, d in events if k == "answer")
    assert answer.strip() == done["answer"] and done["replica"] and done["usage"]["segments"]
    segments = [d["segment"] for k, d in events if k == "segment"]
    assert segments == list(range(done["usage"]["segments"]))


def test_bad_input_gets_clear_errors(client: httpx.Client) -> None:
    cases = [
        ({"context": "   ", "query": QUERY}, 400, "invalid_input"),
        ({"query": QUERY}, 422, "invalid_request"),
        ({"context": "x", "document_id": "d", "query": QUERY}, 422, "invalid_request"),
        ({"context": "Fine.", "query": QUERY, "options": {"relevance": "maybe"}}, 422, None),
        ({"context": "Long. " * 5000, "query": QUERY}, 413, "too_long"),
        ({"document_id": "doc-unknown", "query": QUERY}, 404, "not_found"),
        # Relevance words that share their first token: refused before any reservation.
        (
            {
                "context": "Fine.",
                "query": QUERY,
                "options": {"prompts": {"yes": "Nope", "no": "Nah"}},
            },
            400,
            "invalid_input",
        ),
    ]
    for body, status, code in cases:
        response = client.post("/wim", json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["message"]
        if code:
            assert response.json()["code"] == code
    assert client.post("/documents", json={"context": ""}).status_code == 422
    assert client.get("/healthz").json() == {"status": "ok"}
    wait_for(lambda: settled(client), "no reservation left by the refused requests", 60)
    again = client.post("/wim", json={"context": "The gate code is 4417.", "query": QUERY})
    assert again.status_code == 200, again.text


def test_metrics_are_exported_and_move(client: httpx.Client, report: str) -> None:
    from wim_service.serving.observability.metrics import MAINTENANCE_STEPS, METRIC_NAMES

    text = client.get("/metrics").text
    for name in METRIC_NAMES:
        assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, name
    assert "doc-" not in text  # no document ids in metrics
    # Each maintenance step's failures are counted from 0, so an alert's increase() sees the
    # first one (serving/observability/metrics.py).
    maintenance = [line for line in text.splitlines() if line.startswith(MAINTENANCE + "{")]
    for step in MAINTENANCE_STEPS:
        assert any(f'step="{step}"' in line for line in maintenance), step
    moving = {
        ("wim_requests_total", (("status", "200"),)): 1,
        ("wim_session_binding_total", (("result", "new"),)): 1,
        ("wim_margins_total", ()): 1,
        ("wim_segment_prefill_seconds_count", ()): 1,
        ("wim_margin_seconds_count", ()): 1,
        ("wim_query_ttft_seconds_count", ()): 1,
        ("wim_request_seconds_count", ()): 1,
        ("wim_prefix_cache_hit_tokens_total", ()): 1,
        ("vllm:prompt_tokens_total", ()): 1,
        # Their loop monitors wake 4 times a second; the replicas' reach /metrics via the router.
        ("wim_event_loop_lag_seconds_count", (("deployment", "router"),)): 1,
        ("wim_event_loop_lag_seconds_count", (("deployment", "replica"),)): 1,
    }
    before = {key: metric(client, key[0], **dict(key[1])) for key in moving}
    response = client.post("/wim", json={"context": report, "query": QUERY, "options": OPTIONS})
    assert response.status_code == 200
    for key, at_least in moving.items():
        assert metric(client, key[0], **dict(key[1])) >= before[key] + at_least, key


def test_client_disconnect_cancels_the_job(client: httpx.Client, report: str) -> None:
    margins = metric(client, "wim_margins_total")
    prompt_tokens = metric(client, "vllm:prompt_tokens_total")
    body = {"context": report * 2, "query": QUERY, "options": OPTIONS, "stream": True}
    with client.stream("POST", "/wim", json=body) as response:
        for block in response.iter_text():
            if "event: segment" in block:
                break  # leave after the first segment: the job is far from done
    wait_for(lambda: metric(client, "wim_requests_total", status="499") >= 1, "a 499", 120)
    wait_for(lambda: settled(client), "the cancelled job's KV returned", 120)
    # It stopped early: a full run reads ~7,300 document tokens in ~38 segments, each with a
    # margin; the cancelled one wrote at most a margin or two and read far less of the document.
    assert metric(client, "wim_margins_total") - margins <= 2
    assert metric(client, "vllm:prompt_tokens_total") - prompt_tokens < 4000


def router_log() -> str:
    """What the WiM routers wrote to their Serve logs in this Ray session."""
    routers = (session_logs() / "serve").glob("*WiMRouter*.log")
    return "".join(path.read_text(errors="replace") for path in routers)


def _replica_actor(replica: str):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    replica_id = ReplicaID(replica, DeploymentID("EngineReplica", "wim"))
    return ray.get_actor(replica_id.to_full_id_str(), namespace="serve")


def _engine_core_pid(replica: str) -> int:
    import psutil
    import ray

    # Asked of the actor itself: Ray's state API needs the dashboard, which these tests do
    # not start.
    pid = ray.get(_replica_actor(replica).__ray_call__.remote(lambda _: os.getpid()), timeout=120)
    cores = [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    assert len(cores) == 1, cores
    return cores[0].pid


@pytest.mark.replica_step(1)
def test_killing_the_pinned_replica_mid_request_still_answers(
    client: httpx.Client, report: str
) -> None:
    import ray

    document = open_document(client, report)
    failovers = metric(client, "wim_session_failover_total", reason="replica_lost")
    reprefilled = metric(client, "wim_reprefill_tokens_total")
    restored = {
        r: metric(client, "wim_kv_restored_tokens_total", replica=r) for r in ready_replicas(client)
    }
    stream = Stream(query_body(document["document_id"]))
    stream.wait_for_event("margin")  # the query is running on the pinned replica
    ray.kill(_replica_actor(document["replica"]), no_restart=True)
    events = stream.join()
    assert stream.status == 200
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done", events[-3:]
    margins = [d["segment"] for k, d in events if k == "margin"]
    assert len(margins) == len(set(margins)) == document["segments"]  # none repeated
    done = events[-1][1]
    assert done["answer"] and done["replica"] != document["replica"]
    assert metric(client, "wim_session_failover_total", reason="replica_lost") > failovers
    # Rebuilt from the document's KV that the lost replica saved as it read it: restored,
    # not read again (counted by the replica that restored it; the engines' samples on
    # /metrics may be 5 s old, `METRICS_MAX_AGE_S`, so the count shows within that).
    tokens, survivor = document["context_tokens"], done["replica"]
    wait_for(
        lambda: (
            metric(client, "wim_kv_restored_tokens_total", replica=survivor)
            - restored.get(survivor, 0.0)
            >= 0.8 * tokens
        ),
        "the survivor's restore in /metrics",
        15,
    )
    assert metric(client, "wim_reprefill_tokens_total") - reprefilled <= 0.2 * tokens
    # The router says so in its Serve log (docs/serving.md, "Logs").
    move = f"a document session moved {document['replica']} -> {done['replica']} (replica_lost)"
    wait_for(lambda: move in router_log(), "the move in the router's log", 10)
    # The session now lives on the new replica and is served from its pinned KV there.
    body = query_body(document["document_id"])
    again = client.post("/wim", json=body)
    assert again.status_code == 200 and again.json()["replica"] == done["replica"]
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204


@pytest.mark.replica_step(3)
def test_engine_process_death_fails_over_and_the_replica_leaves(
    client: httpx.Client, report: str
) -> None:
    """SIGKILL of the pinned replica's EngineCore process mid-stream: the query completes on
    the other replica, the session moves, and the dead replica stops taking work."""
    document = open_document(client, report)
    dead = document["replica"]
    stream = Stream(query_body(document["document_id"]))
    stream.wait_for_event("margin")
    os.kill(_engine_core_pid(dead), signal.SIGKILL)
    events = stream.join()
    assert stream.status == 200 and events[-1][0] == "done", events[-3:]
    assert events[-1][1]["replica"] != dead
    wait_for(lambda: dead not in ready_replicas(client), "the dead replica off /readyz", 60)
    # A new one-shot job goes to a live engine, and the session answers from its new home.
    for body in (
        {"context": report, "query": QUERY, "options": OPTIONS},
        query_body(document["document_id"]),
    ):
        response = client.post("/wim", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["replica"] != dead
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204


@pytest.mark.replica_step(5)
def test_scale_down_drains_and_moves_sessions(
    live_stack: LiveStack, client: httpx.Client, report: str
) -> None:
    """Scale to one replica: running work finishes, sessions of the leaving replica move."""
    documents = [open_document(client, report)]
    try:
        while len({d["replica"] for d in documents}) < 2:  # a session on each replica
            documents.append(open_document(client, report))
        _drain_and_move(live_stack, client, documents)
    finally:
        for document in documents:
            client.delete(f"/documents/{document['document_id']}")


def _drain_and_move(live_stack: LiveStack, client: httpx.Client, documents: list[dict]) -> None:
    moved = metric(client, "wim_session_failover_total", reason="replica_left")
    bodies = [query_body(d["document_id"]) for d in documents]
    # The router shows a replica draining, at its next poll and page, only while calls of its
    # run there; the leaving replica leaves its routing set about a second after the deploy.
    # One query on a read document takes about that long (its margins come in one batch,
    # near its end), so each document gets ten at once, and the scale-down starts as soon as
    # they have begun: they then run about 2.5 s in all.
    streams = [Stream(body) for body in bodies for _ in range(10)]
    for stream in streams[::10]:
        wait_for(lambda stream=stream: stream.events, "a query's first event", 120)
    draining_seen = threading.Event()

    def watch_draining() -> None:
        while not draining_seen.is_set() and any(s._thread.is_alive() for s in streams):
            if metric(client, "wim_replica_draining") >= 1:
                draining_seen.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_draining)
    watcher.start()
    live_stack.deploy(MAIN, engines=1)
    results = [stream.join() for stream in streams]
    watcher.join(60)
    assert [s.status for s in streams] == [200] * len(streams)
    assert all(events[-1][0] == "done" for events in results)
    assert draining_seen.is_set(), "wim_replica_draining never went to 1"
    (survivor,) = wait_for(
        lambda: (r := ready_replicas(client)) and len(r) == 1 and r, "one replica left"
    )
    # Every session still answers, now from the surviving replica; those of the leaving one
    # were moved (counted as replica_left).
    for body in bodies:
        response = client.post("/wim", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["replica"] == survivor
    assert metric(client, "wim_session_failover_total", reason="replica_left") > moved


@pytest.mark.replica_step(4)
def test_a_replica_started_while_calls_run_is_used_within_seconds(
    live_stack: LiveStack, one_engine_client: httpx.Client, short_report: str
) -> None:
    """Scale 1 -> 2 while jobs run: the new replica reports its load within seconds of Serve
    marking it running (it once stayed unreachable for minutes)."""
    from ray import serve

    client = one_engine_client
    stop = threading.Event()

    def keep_busy() -> None:
        with httpx.Client(base_url=BASE, timeout=600, headers=auth()) as c:
            while not stop.is_set():
                body = {"context": short_report, "query": QUERY, "options": OPTIONS}
                c.post("/wim", json=body)

    workers = [threading.Thread(target=keep_busy) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        live_stack.deploy(MAIN, engines=2)

        def serve_running() -> bool:
            app = serve.status().applications["wim"]
            engine = app.deployments["EngineReplica"]
            return engine.replica_states.get("RUNNING", 0) == 2

        wait_for(serve_running, "Serve to run two engine replicas")
        running_at = time.monotonic()
        wait_for(lambda: len(ready_replicas(client)) == 2, "the router to reach both", 120)
        assert time.monotonic() - running_at < 30
    finally:
        stop.set()
        for worker in workers:
            worker.join(900)


def test_no_document_text_or_id_reaches_the_logs(client: httpx.Client, report: str) -> None:
    text = report.replace("Section 2.", MARKER + " Section 2.")
    document = open_document(client, text)
    query = "Where is the brass key?"
    response = client.post(
        "/wim", json={"document_id": document["document_id"], "query": query, "options": OPTIONS}
    )
    assert response.status_code == 200
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
    found = []
    for path in session_logs().rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for needle in (MARKER.encode(), b"brass key", document["document_id"].encode()):
                if needle in content:
                    found.append((path.name, needle))
    assert not found, found


def test_after_hostile_traffic_the_service_is_healthy(client: httpx.Client) -> None:
    """A bounded flood of concurrent malformed and oversized requests: only 4xx, then a
    normal job succeeds and nothing is left reserved."""

    async def flood() -> list[int]:
        bodies: list[Any] = [
            b"{not json",
            b'{"context": "\\ud800", "query": "q"}',
            b'{"context": 5, "query": "q"}',
            b'{"context": "x", "query": ""}',
            b'{"context": "x", "query": "q", "options": {"margin_max_tokens": 0}}',
            b'{"context": "x", "query": "q", "options": {"stop_token_ids": [99999999]}}',
        ]
        async with httpx.AsyncClient(base_url=BASE, timeout=120, headers=auth()) as c:
            calls = [
                c.post(
                    "/wim",
                    content=bodies[i % len(bodies)],
                    headers={"content-type": "application/json"},
                )
                for i in range(60)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    statuses = asyncio.run(flood())
    assert statuses and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    wait_for(lambda: settled(client), "no reservation left", 60)
    ok = client.post("/wim", json={"context": "The gate code is 4417.", "query": QUERY})
    assert ok.status_code == 200


@pytest.mark.replica_step(2)
def test_parked_sessions_start_a_second_replica_before_anyone_is_refused(
    live_stack: LiveStack, one_engine_client: httpx.Client, report: str
) -> None:
    """Autoscaling on reserved KV: sessions that hold KV with no request running fill one
    replica; the autoscaler adds a second before a new session would be refused."""
    client = one_engine_client
    # Now free to add one; only the KV that parked sessions hold can make it do so.
    live_stack.deploy(MAIN, engines=1, max_engines=2)
    documents = []
    try:
        while len(ready_replicas(client)) < 2:
            response = client.post("/documents", json={"context": report, "options": OPTIONS})
            assert response.status_code == 201, (len(documents), response.text)
            documents.append(response.json())
            # Three of its four session slots taken (75% > the 50% target): a second replica
            # must come while the first still has a free slot.
            if len(documents) >= 3:
                wait_for(lambda: len(ready_replicas(client)) == 2, "a second replica", 300)
        assert len({d["replica"] for d in documents}) == 1  # all parked on the first one
        third = client.post("/documents", json={"context": report, "options": OPTIONS})
        assert third.status_code == 201 and third.json()["replica"] not in {
            d["replica"] for d in documents
        }
        documents.append(third.json())
    finally:
        for document in documents:
            client.delete(f"/documents/{document['document_id']}")


# Last of all: it stops the application and deploys it again, with one engine.
@pytest.mark.replica_step(6)
def test_a_restarted_service_restores_an_open_document_instead_of_reading_it(
    live_stack: LiveStack, one_engine_client: httpx.Client, report: str
) -> None:
    """Routers and engines stopped and started again, the sessions and the documents' KV in
    Redis: an open document's next query is answered from its restored KV, nothing of it
    read again."""
    client = one_engine_client
    document = open_document(client, report)
    tokens = document["context_tokens"]
    live_stack.restart(MAIN, engines=1)
    (replica,) = wait_for(
        lambda: (r := ready_replicas(client)) and len(r) == 1 and r, "the restarted engine", 900
    )
    assert replica != document["replica"]
    response = client.post("/wim", json=query_body(document["document_id"]))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["replica"] == replica and answer["answer"]
    # Restored on the new engine; the new router computed at most the tail block again.
    assert metric(client, "wim_kv_restored_tokens_total", replica=replica) >= 0.8 * tokens
    assert metric(client, "wim_reprefill_tokens_total") <= 0.2 * tokens
    # Its answer read the restored document from the prefix cache.
    assert answer["usage"]["prompt_tokens_cached"] >= 0.8 * tokens
    assert client.delete(f"/documents/{document['document_id']}").status_code == 204
