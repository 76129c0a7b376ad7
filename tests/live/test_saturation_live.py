"""A full service on the real stack (two engine replicas of 4 session slots, `MAIN`): placement
refuses what finds no room (429), and once placements have kept finding none for
`cheapest_first_short_s` (2 s in the suite's router) the router refuses the costliest arrivals
first while cheap ones are still answered; emptied, it answers again. The engines' pace, by
which the router refuses what would run past the deadline, is measured from their answers."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.harness.live_stack import MAIN, OPTIONS, QUERY, LiveStack, metric, settled, wait_for
from tests.live.test_serving import serving

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]

LIVE_APP = MAIN
TURNED_AWAY = "wim_admission_refused_total"
WATER_LEVEL = "wim_admission_water_level_seconds"
PACE = "wim_admission_pace"
# The router's refusal by cheapest-first admission (`ReplicaFleet.admit`), not placement's.
RULE = "costs more engine time than most"
# Opens refused while the slots stay full, at most; each takes well under a second.
MAX_REFUSED_OPENS = 60


@pytest.fixture
def client(live_stack: LiveStack) -> Iterator[httpx.Client]:
    yield from serving(live_stack, engines=2)


def cheap_completion(client: httpx.Client) -> int:
    """A plain request of a few tokens: it takes no session slot, so a full fleet runs it."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1}
    return client.post("/v1/completions", json=body).status_code


def test_a_full_service_answers_429_refuses_costliest_first_then_recovers(
    client: httpx.Client, short_report: str
) -> None:
    rejected = metric(client, "wim_session_binding_total", result="rejected")
    turned_away = metric(client, TURNED_AWAY)
    assert metric(client, WATER_LEVEL) == float("inf")
    body = {"context": short_report, "options": OPTIONS}
    opened, refused = [], None
    try:
        # 2 replicas x max_sessions 4 at most; short documents: the session slots fill first
        # (each open prefills its document, minutes for the whole report on 2 busy cores).
        for _ in range(12):
            response = client.post("/documents", json=body)
            if response.status_code != 201:
                refused = response
                break
            opened.append(response.json()["document_id"])
        assert refused is not None and refused.status_code == 429, refused
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["code"] == "overloaded"
        # Refused by the router's placement (KV or session slots), not after an engine's wait.
        assert metric(client, "wim_session_binding_total", result="rejected") == rejected + 1
        assert metric(client, "wim_requests_total", status="429") >= 1

        # Kept full: cheap requests answered, documents refused for want of room, until the
        # rule acts and refuses a document (a WiM query's worth of engine time) itself.
        for _ in range(MAX_REFUSED_OPENS):
            assert cheap_completion(client) == 200
            refused = client.post("/documents", json=body)
            assert refused.status_code == 429, refused.text
            if RULE in refused.json()["message"]:
                break
            time.sleep(0.2)  # paces the load: the rule waits for 2 s of refusals
        assert RULE in refused.json()["message"], refused.text
        assert refused.json()["code"] == "overloaded"
        assert int(refused.headers["Retry-After"]) >= 1
        assert cheap_completion(client) == 200  # cheaper than the water level: answered
        wait_for(lambda: metric(client, TURNED_AWAY) >= turned_away + 1, "the refusal counted")
    finally:
        for document_id in opened:
            assert client.delete(f"/documents/{document_id}").status_code == 204
    wait_for(lambda: settled(client), "the freed reservations in the next load poll", 60)
    wait_for(lambda: metric(client, WATER_LEVEL) == float("inf"), "the rule letting go", 60)
    body = {"context": short_report, "query": QUERY, "options": OPTIONS}
    after = client.post("/wim", json=body)
    assert after.status_code == 200, after.text
    # The pace: what the engines' own timings of their answers say an estimated second takes.
    for _ in range(10):
        assert cheap_completion(client) == 200
    wait_for(lambda: not math.isnan(metric(client, PACE)), "the pace measured", 30)
    assert 0.01 < metric(client, PACE) < 100
