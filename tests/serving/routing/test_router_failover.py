"""The router's failover over fake engine replicas (no Ray, no engine): a session whose replica
is lost, left or forgot it is rebuilt elsewhere, a one-shot job fails over and gives up after
`max_failovers`, and a lost replica takes no new session."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from fastapi.testclient import TestClient

from tests.fakes.replicas import DOCUMENT, FakeReplica
from tests.fakes.router import UnnoticedDeaths, make_service, metric
from wim_service.serving.ingress import build_http_app
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoredSession
from wim_service.wim.options import WiMOptions


def test_losing_the_pinned_replica_mid_query_rebuilds_the_session_elsewhere() -> None:
    a, b = FakeReplica("a"), FakeReplica("b", capacity=1_000)
    client, router = make_service(a, b)
    document = client.post("/documents", json={"context": DOCUMENT}).json()
    assert document["replica"] == "a"
    a.die_after = 4  # two segments and two margins streamed, then the actor dies
    body = {"document_id": document["document_id"], "query": "q", "stream": True}
    with client.stream("POST", "/wim", json=body) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    events = [(k, json.loads(d)) for k, d in re.findall(r"event: (\w+)\ndata: (.*)\n\n", text)]
    kinds = [k for k, _ in events]
    # No segment or margin is sent twice, nothing is lost, and the answer is whole.
    assert [d["segment"] for k, d in events if k == "segment"] == [0, 1, 2]
    assert [d["segment"] for k, d in events if k == "margin"] == [0, 1, 2]
    assert "".join(d["text"] for k, d in events if k == "answer") == "The code is 4417."
    assert kinds[-1] == "done" and events[-1][1]["replica"] == "b"
    work = [call for call in b.calls if call not in ("load", "claim")]
    assert work[:2] == ["open_document", "query_document"]  # rebuilt, then asked
    moved = asyncio.run(router.documents.get(document["document_id"]))
    assert moved is not None and moved.replica == "b"
    assert metric(client, "wim_session_failover_total", reason="replica_lost") == 1
    assert metric(client, "wim_reprefill_tokens_total") == len(DOCUMENT) // 4
    again = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
    assert again.json()["replica"] == "b"


def test_a_replica_lost_mid_query_takes_no_new_session_while_serve_still_lists_it() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    router = WiMRouter(
        None, {"router": {"replica_wait_s": 0}}, client=UnnoticedDeaths(a, b), http_host="::1"
    )
    client = TestClient(build_http_app(router))
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True
    moved = client.post("/wim", json={"document_id": document_id, "query": "q"})
    assert moved.json()["replica"] == "b"
    # a's load polls fail now and its last report stays: only the failover condemned it.
    assert client.post("/documents", json={"context": DOCUMENT}).json()["replica"] == "b"
    assert client.post("/wim", json={"context": DOCUMENT, "query": "q"}).json()["replica"] == "b"
    assert metric(client, "wim_session_failover_total", reason="replica_lost") == 1
    assert router.fleet.ready() == ["b"]


def moves(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "wim_service.serving.routing.failover"
    ]


def test_a_session_whose_replica_left_is_rebuilt_before_its_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    client, router = make_service(a, b)
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True
    asyncio.run(router.fleet.refresh_loads())  # Serve no longer routes to a
    caplog.set_level(logging.INFO, logger="wim_service.serving.routing.failover")
    answer = client.post("/wim", json={"document_id": document_id, "query": "q"})
    assert answer.status_code == 200 and answer.json()["replica"] == "b"
    assert [c for c in b.calls if c not in ("load", "claim")] == [
        "open_document",
        "query_document",
    ]
    moved = asyncio.run(router.documents.get(document_id))
    assert moved is not None and moved.replica == "b"
    assert metric(client, "wim_session_failover_total", reason="replica_left") == 1
    assert metric(client, "wim_session_failover_total", reason="replica_lost") == 0
    assert metric(client, "wim_session_binding_total", result="repin") == 1
    assert metric(client, "wim_session_binding_total", result="hit") == 0
    assert metric(client, "wim_reprefill_tokens_total") == len(DOCUMENT) // 4
    # The move is logged with its replicas and reason, never with the document's id.
    assert moves(caplog) == ["a document session moved a -> b (replica_left)"]
    assert document_id not in caplog.text


def test_a_session_bound_to_no_replica_is_read_on_its_first_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, router = make_service(FakeReplica("a"))
    # Stored unbound (as another router's store may hold it): no replica was lost.
    unbound = StoredSession("doc-unbound", WiMOptions(), ttl_s=600.0)
    asyncio.run(router.documents.add(unbound, DOCUMENT))
    caplog.set_level(logging.INFO, logger="wim_service.serving.routing.failover")
    answer = client.post("/wim", json={"document_id": "doc-unbound", "query": "q"})
    assert answer.status_code == 200 and answer.json()["replica"] == "a"
    bound = asyncio.run(router.documents.get("doc-unbound"))
    assert bound is not None and bound.replica == "a"
    assert metric(client, "wim_session_failover_total") == 0
    assert metric(client, "wim_session_binding_total", result="repin") == 1
    assert moves(caplog) == ["a document session moved None -> a (session_lost)"]


def test_a_replica_that_forgot_the_session_gets_it_rebuilt() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    client, _ = make_service(a, b)
    document = client.post("/documents", json={"context": DOCUMENT}).json()
    a.documents.clear()  # the replica restarted
    response = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
    assert response.status_code == 200
    assert a.calls.count("open_document") + b.calls.count("open_document") == 2


def test_a_sole_replica_that_forgot_the_session_rebuilds_it_at_once() -> None:
    """A replica that answers "not here" (restarted, or another router closed that copy) is
    alive: the session is read again, there if need be, and the replica keeps taking work.
    Taken for lost, it was excluded from the rebuild: with no other replica up, the query
    waited `replica_wait_s` (0 here) for one and then answered 503."""
    a = FakeReplica("a")
    client, router = make_service(a)
    document = client.post("/documents", json={"context": DOCUMENT}).json()
    a.documents.clear()
    response = client.post("/wim", json={"document_id": document["document_id"], "query": "q"})
    assert response.status_code == 200, response.text
    assert response.json()["replica"] == "a" and a.calls.count("open_document") == 2
    assert router.fleet.ledger.is_live("a") and router.fleet.ready() == ["a"]
    assert metric(client, "wim_session_failover_total", reason="session_missing") == 1
    assert metric(client, "wim_session_failover_total", reason="replica_lost") == 0


def test_one_shot_job_fails_over_and_gives_up_after_max_failovers() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    a.die_after = 1
    client, _ = make_service(a, b)
    moved = client.post("/wim", json={"context": DOCUMENT, "query": "q"})
    assert moved.status_code == 200 and moved.json()["replica"] == "b"
    assert metric(client, "wim_session_binding_total", result="repin") == 1

    # Two losses with max_failovers 1: the job gives up, though a healthy replica is left.
    c, d, e = (
        FakeReplica("c", capacity=100_000),
        FakeReplica("d", capacity=50_000),
        FakeReplica("e"),
    )
    c.die_after = d.die_after = 0
    failing, _ = make_service(c, d, e, max_failovers=1)
    response = failing.post("/wim", json={"context": DOCUMENT, "query": "q"})
    # Replicas lost, not a bad request: retryable.
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.text
    message = response.json()["message"]
    assert message.startswith("engine replicas kept failing") and "RuntimeError" not in message
    assert [r.calls.count("run") for r in (c, d, e)] == [1, 1, 0]
    assert metric(failing, "wim_session_binding_total", result="repin") == 1
