"""The service end to end: local Ray Serve, two real vLLM engine replicas, real HTTP.

Tests run in file order; the last ones kill and remove replicas.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serving

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"
QUERY = "What is the access code for the night gate?"
ENGINE = {
    "dtype": "bfloat16",
    "max_model_len": 4096,
    # Room for two of the test's document sessions per replica: after scale-down the survivor
    # must take the leaving replica's session too.
    "kv_cache_gib": 0.5,
    "block_size": 32,
    "max_num_seqs": 32,
    # Two engines on two cores: one core each.
    "cpu_threads_bind": "rank",
    "max_sessions": 4,
    "admission_timeout_s": 2,
}
ROUTER = {"session_ttl_s": 600, "load_poll_interval_s": 1.0, "replica_wait_s": 240}
OPTIONS = {"segment_tokens": 192, "margin_max_tokens": 16, "answer_max_tokens": 16}


def deploy(replicas: int) -> None:
    """Deploy the app as `serve deploy` would: from a config, so that changing only
    `num_replicas` later is a lightweight update (the router, with its sessions, stays)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = {
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [
            {
                "name": "wim",
                "route_prefix": "/",
                "import_path": "wim_service.serving.app:build_app",
                "args": {"engine": ENGINE, "router": ROUTER},
                "deployments": [{"name": "EngineReplica", "num_replicas": replicas}],
            }
        ],
    }
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


@pytest.fixture(scope="module")
def service() -> Iterator[httpx.Client]:
    os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 (Ray reads this exact name)
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    deploy(2)
    client = httpx.Client(base_url=BASE, timeout=600)
    deadline = time.monotonic() + 600
    ready = None
    while time.monotonic() < deadline:
        ready = client.get("/readyz") if _listening() else None
        if ready is not None and ready.status_code == 200 and len(ready.json()["replicas"]) == 2:
            break
        time.sleep(2)
    else:
        pytest.fail(f"the service did not become ready: {ready and ready.text}")
    yield client
    client.close()
    serve.shutdown()
    ray.shutdown()


def _listening() -> bool:
    try:
        httpx.get(f"{BASE}/healthz", timeout=5)
    except httpx.TransportError:
        return False
    return True


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """Sum of a metric's samples matching `labels` in GET /metrics."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def open_document(client: httpx.Client, text: str) -> dict:
    response = client.post("/documents", json={"context": text, "options": OPTIONS})
    assert response.status_code == 201, response.text
    return response.json()


def test_one_shot_job_over_http(service: httpx.Client, report: str) -> None:
    response = service.post("/wim", json={"context": report, "query": QUERY, "options": OPTIONS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"] and body["replica"] and body["session_id"].startswith("job-")
    assert [m["segment"] for m in body["margins"]] == list(range(body["usage"]["segments"]))
    assert body["usage"]["prompt_tokens_cached"] > 0


def test_document_session_is_pinned_and_reuses_its_kv(service: httpx.Client, report) -> None:
    document = open_document(service, report)
    assert document["context_tokens"] > 1000 and document["segments"] >= 5
    replicas = set()
    for query in (QUERY, "Who replaced Margaret Oyelaran?", "How many boats are registered?"):
        response = service.post(
            "/wim", json={"document_id": document["document_id"], "query": query}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        replicas.add(body["replica"])
        usage = body["usage"]
        # The document is not prefilled again: only margin/final instructions and the partial
        # blocks at segment ends are computed.
        assert usage["prompt_tokens_computed"] - usage["minimal_prompt_tokens"] < 32 * 8
        assert usage["prompt_tokens_cached"] >= (document["context_tokens"] // 32) * 32
    assert replicas == {document["replica"]}
    assert service.get(f"/documents/{document['document_id']}").json()["replica"] in replicas
    assert service.delete(f"/documents/{document['document_id']}").status_code == 204
    gone = service.post("/wim", json={"document_id": document["document_id"], "query": QUERY})
    assert gone.status_code == 404 and gone.json()["code"] == "not_found"


def test_sse_streams_events_in_order(service: httpx.Client, report: str) -> None:
    events: list[tuple[str, str]] = []
    body = {"context": report, "query": QUERY, "options": OPTIONS, "stream": True}
    with service.stream("POST", "/wim", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for block in response.iter_text():
            events.extend(re.findall(r"event: (\w+)\ndata: (.*)\n\n", block))
    kinds = [k for k, _ in events]
    assert kinds[0] == "segment" and kinds[-1] == "done"
    assert kinds.index("answer") > max(i for i, k in enumerate(kinds) if k == "margin")
    assert max(i for i, k in enumerate(kinds) if k == "segment") < kinds.index("answer")
    import json

    done = json.loads(events[-1][1])
    answer = "".join(json.loads(d)["text"] for k, d in events if k == "answer")
    assert answer.strip() == done["answer"] and done["replica"] and done["usage"]["segments"]
    segments = [json.loads(d)["segment"] for k, d in events if k == "segment"]
    assert segments == list(range(done["usage"]["segments"]))


def test_bad_input_gets_clear_errors(service: httpx.Client) -> None:
    cases = [
        ({"context": "   ", "query": QUERY}, 400, "invalid_input"),
        ({"query": QUERY}, 422, "invalid_request"),
        ({"context": "x", "document_id": "d", "query": QUERY}, 422, "invalid_request"),
        ({"context": "Fine.", "query": QUERY, "options": {"relevance": "maybe"}}, 422, None),
        ({"context": "Long. " * 5000, "query": QUERY}, 413, "too_long"),
        ({"document_id": "doc-unknown", "query": QUERY}, 404, "not_found"),
    ]
    for body, status, code in cases:
        response = service.post("/wim", json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["message"]
        if code:
            assert response.json()["code"] == code
    assert service.post("/documents", json={"context": ""}).status_code == 422
    assert service.get("/healthz").json() == {"status": "ok"}


def test_overload_answers_429_then_recovers(service: httpx.Client, report: str) -> None:
    opened, refused = [], None
    for _ in range(12):  # 2 replicas x max_sessions 4 at most, KV usually fills first
        response = service.post("/documents", json={"context": report, "options": OPTIONS})
        if response.status_code != 201:
            refused = response
            break
        opened.append(response.json()["document_id"])
    assert refused is not None and refused.status_code in (429, 503), refused
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["code"] == "overloaded"
    for document_id in opened:
        assert service.delete(f"/documents/{document_id}").status_code == 204
    time.sleep(2)  # the next load poll sees the freed reservations
    after = service.post("/wim", json={"context": report, "query": QUERY, "options": OPTIONS})
    assert after.status_code == 200, after.text
    if refused.status_code == 429:  # refused by the router's placement, not an engine's queue
        assert metric(service, "wim_session_binding_total", result="rejected") >= 1


def test_metrics_are_exported_and_move(service: httpx.Client, report: str) -> None:
    from wim_service.serving.metrics import METRIC_NAMES

    text = service.get("/metrics").text
    for name in METRIC_NAMES:
        assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, name
    assert re.search(r'^vllm:num_requests_running\{.*replica="', text, re.M)
    before = metric(service, "wim_requests_total", status="200")
    margins = metric(service, "wim_margins_total")
    assert (
        service.post(
            "/wim", json={"context": report, "query": QUERY, "options": OPTIONS}
        ).status_code
        == 200
    )
    assert metric(service, "wim_requests_total", status="200") == before + 1
    assert metric(service, "wim_margins_total") > margins


def test_client_disconnect_cancels_the_job(service: httpx.Client, report: str) -> None:
    body = {"context": report * 2, "query": QUERY, "options": OPTIONS, "stream": True}
    with service.stream("POST", "/wim", json=body) as response:
        for block in response.iter_text():
            if "event: segment" in block:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sessions = metric(service, "wim_sessions_active")
        if sessions == 0:
            break
        time.sleep(1)
    assert sessions == 0
    assert metric(service, "wim_requests_total", status="499") >= 1


def _replica_actor(replica: str):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    replica_id = ReplicaID(replica, DeploymentID("EngineReplica", "wim"))
    return ray.get_actor(replica_id.to_full_id_str(), namespace="serve")


def test_killing_the_pinned_replica_mid_request_still_answers(
    service: httpx.Client, report: str
) -> None:
    import ray

    document = open_document(service, report)
    failovers = metric(service, "wim_session_failover_total")
    reprefilled = metric(service, "wim_reprefill_tokens_total")
    result: dict = {}

    def ask() -> None:
        result["response"] = service.post(
            "/wim",
            json={
                "document_id": document["document_id"],
                "query": QUERY,
                "options": {"margin_max_tokens": 48, "answer_max_tokens": 48},
            },
        )

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(1.0)  # the query is running on the pinned replica
    ray.kill(_replica_actor(document["replica"]), no_restart=True)
    thread.join(600)
    response = result["response"]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"] and body["replica"] != document["replica"]
    assert metric(service, "wim_session_failover_total") > failovers
    assert metric(service, "wim_reprefill_tokens_total") >= reprefilled + document["context_tokens"]
    # The session now lives on the new replica and is served from its pinned KV there.
    again = service.post("/wim", json={"document_id": document["document_id"], "query": QUERY})
    assert again.status_code == 200 and again.json()["replica"] == body["replica"]
    assert service.delete(f"/documents/{document['document_id']}").status_code == 204


def test_scale_down_drains_and_keeps_sessions(service: httpx.Client, report: str) -> None:
    """Scale to one replica: running work finishes, sessions of the leaving replica move."""
    # Wait for the replacement of the replica killed above: two replicas again.
    deadline = time.monotonic() + 600
    while len(service.get("/readyz").json()["replicas"]) < 2 and time.monotonic() < deadline:
        time.sleep(2)
    documents = [open_document(service, report) for _ in range(2)]
    results: list[httpx.Response] = []

    async def ask_all() -> None:
        async with httpx.AsyncClient(base_url=BASE, timeout=600) as client:
            calls = [
                client.post("/wim", json={"document_id": d["document_id"], "query": QUERY})
                for d in documents
            ]
            results.extend(await asyncio.gather(*calls))

    thread = threading.Thread(target=lambda: asyncio.run(ask_all()))
    thread.start()
    time.sleep(0.5)
    deploy(1)
    thread.join(600)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    while len(service.get("/readyz").json()["replicas"]) > 1 and time.monotonic() < deadline:
        time.sleep(1)
    (survivor,) = service.get("/readyz").json()["replicas"]
    # Every session still answers, now from the surviving replica.
    for document in documents:
        response = service.post(
            "/wim", json={"document_id": document["document_id"], "query": QUERY}
        )
        assert response.status_code == 200, response.text
        assert response.json()["replica"] == survivor
