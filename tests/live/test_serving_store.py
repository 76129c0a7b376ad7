"""Several routers over one Redis session store, on the real stack: local Ray Serve with two
WiMRouter replicas, two vLLM engine replicas and a real redis-server, real HTTP.

Serve's proxy spreads requests over the router replicas; each answer names its router
(`X-WiM-Router`), so a test can tell which router served what.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.harness.live_stack import (
    BASE,
    OPTIONS,
    TWO_ROUTERS,
    LiveStack,
    auth,
    from_pinned_kv,
    metric,
    open_client,
    parse_sse,
    query_body,
    ready_replicas,
    wait_for,
)
from tests.harness.redis_server import RedisServer

# Real engines start and move in minutes on a busy 2-core machine.
pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]

LIVE_APP = TWO_ROUTERS


def routers_running() -> int:
    """Router replicas running, 0 while the application is still being (re)deployed: during a
    rolling update the old routers still run, and Serve's proxy may send a request to one
    that is stopping (it answers 500 after 20 s)."""
    from ray import serve

    app = serve.status().applications.get("wim")
    router = app.deployments.get("WiMRouter") if app and app.status == "RUNNING" else None
    return router.replica_states.get("RUNNING", 0) if router else 0


def ready(client: httpx.Client) -> bool:
    return routers_running() == 2 and len(ready_replicas(client)) == 2


@pytest.fixture
def service(live_stack: LiveStack) -> Iterator[httpx.Client]:
    live_stack.deploy(TWO_ROUTERS, engines=2)
    with open_client() as client:
        wait_for(lambda: ready(client), "two routers and two engine replicas", 900)
        yield client


def open_document(client: httpx.Client, text: str) -> tuple[dict, str]:
    response = client.post("/documents", json={"context": text, "options": OPTIONS})
    assert response.status_code == 201, response.text
    return response.json(), response.headers["X-WiM-Router"]


def ask_until_router(
    client: httpx.Client, document_id: str, wanted: Any, tries: int = 30
) -> httpx.Response:
    """Query until a router that `wanted(router)` accepts answers (the proxy picks)."""
    for _ in range(tries):
        response = client.post("/wim", json=query_body(document_id))
        assert response.status_code == 200, response.text
        if wanted(response.headers["X-WiM-Router"]):
            return response
    pytest.fail("the proxy never chose the wanted router")


def _router_actor(name: str):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    replica_id = ReplicaID(name, DeploymentID("WiMRouter", "wim"))
    return ray.get_actor(replica_id.to_full_id_str(), namespace="serve")


def test_a_session_opened_through_one_router_is_served_by_another(
    service: httpx.Client, short_report: str
) -> None:
    document, opener = open_document(service, short_report)
    response = ask_until_router(service, document["document_id"], lambda r: r != opener)
    body = response.json()
    assert body["replica"] == document["replica"] and from_pinned_kv(body, document)
    # A DELETE through either router is seen by both at once.
    deleted = service.delete(f"/documents/{document['document_id']}")
    assert deleted.status_code == 204
    for _ in range(6):
        gone = service.get(f"/documents/{document['document_id']}")
        assert gone.status_code == 404


def start_stream(document_id: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A streamed question in a thread; returns once its first event arrived. The result holds
    the answering router, the events so far and any transport error.

    The answer starts after the margins (`answer_early` off): started early, it streams in one
    burst right after the last margin, and the stream could end before a router is killed."""
    result: dict[str, Any] = {}

    def stream() -> None:
        body = query_body(document_id)
        body = {**body, "options": {**body["options"], "answer_early": False}, "stream": True}
        text = ""
        try:
            with httpx.stream(
                "POST", f"{BASE}/wim", json=body, timeout=600, headers=auth()
            ) as response:
                result["router"] = response.headers["X-WiM-Router"]
                for chunk in response.iter_text():
                    text += chunk
                    result["events"] = parse_sse(text)
        except httpx.HTTPError as exc:
            result["error"] = exc
        result["events"] = parse_sse(text)

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: "router" in result and result.get("events"), "the stream to start", 300)
    return thread, result


def test_a_killed_router_loses_no_session(service: httpx.Client, short_report: str) -> None:
    import ray

    document, _ = open_document(service, short_report)
    path = f"/documents/{document['document_id']}"
    try:
        # A stream through some router; then that router dies mid-stream.
        thread, result = start_stream(document["document_id"])
        ray.kill(_router_actor(result["router"]), no_restart=False)
        thread.join(600)
        kinds = [k for k, _ in result["events"]]
        # The stream that was on the killed router ends without `done` (a clear failure)...
        assert "done" not in kinds or "error" in result
        # ... and the client's retry is answered from the session's KV by a live router: on
        # its replica, or on a copy if the killed router's job still runs there (`wim`
        # placement); the session itself stays where it was, not rebuilt.
        retry = service.post("/wim", json=query_body(document["document_id"]))
        assert retry.status_code == 200, retry.text
        assert retry.headers["X-WiM-Router"] != result["router"]
        assert from_pinned_kv(retry.json(), document)
        assert service.get(path).json()["replica"] == document["replica"]
    finally:
        # Whatever failed: a session left open would hold KV under the next tests.
        assert service.delete(path).status_code == 204


# Last in its application: it redeploys the routers with other actor options, which a test
# after it would have to redeploy back.
@pytest.mark.replica_step(1)
def test_a_router_redeploy_keeps_every_session(
    live_stack: LiveStack, service: httpx.Client, short_report: str
) -> None:
    documents = [open_document(service, short_report)[0] for _ in range(2)]
    before = {r for r in (service.get("/healthz").headers["X-WiM-Router"] for _ in range(8))}
    # A stream open through an old router while it is replaced runs to its end.
    thread, streamed = start_stream(documents[0]["document_id"])
    # New router replicas, the engines untouched (a change of the application's args would
    # restart them too).
    live_stack.deploy(
        TWO_ROUTERS,
        engines=2,
        # Not a CPU: the two engines hold both of the cluster's CPUs.
        router_actor_options={"num_cpus": 0, "memory": 2**20},
    )
    wait_for(
        lambda: (
            ready(service)
            and not before & {service.get("/healthz").headers["X-WiM-Router"] for _ in range(6)}
        ),
        "the redeployed routers",
        600,
    )
    thread.join(600)
    assert streamed["router"] in before and "error" not in streamed
    assert [kind for kind, _ in streamed["events"]][-1] == "done"
    for document in documents:
        response = service.post("/wim", json=query_body(document["document_id"]))
        assert response.status_code == 200, response.text
        assert response.json()["replica"] == document["replica"]
        assert from_pinned_kv(response.json(), document)
        assert service.delete(f"/documents/{document['document_id']}").status_code == 204


def test_redis_down_answers_503_and_recovers(
    service: httpx.Client, short_report: str, redis_server: RedisServer
) -> None:
    document, _ = open_document(service, short_report)
    redis_server.pause()
    try:
        for call in (
            lambda: service.post("/wim", json=query_body(document["document_id"])),
            lambda: service.post("/documents", json={"context": short_report, "options": OPTIONS}),
        ):
            response = call()
            assert response.status_code == 503, response.text
            assert response.json()["code"] == "unavailable"
            assert int(response.headers["Retry-After"]) >= 1
    finally:
        redis_server.resume()
    response = service.post("/wim", json=query_body(document["document_id"]))
    assert response.status_code == 200, response.text
    assert service.delete(f"/documents/{document['document_id']}").status_code == 204
    # Nothing the refused requests started is left reserved on the engines.
    wait_for(
        lambda: (
            metric(service, "wim_kv_reserved_blocks") == 0
            and metric(service, "wim_sessions_active") == 0
        ),
        "no reservation left",
        120,
    )
