"""The Grafana dashboard and the alert rules on a real Prometheus scraping the real service.

`promtool` checks the rules' syntax and their unit tests
(tests/deploy/test_deploy_observability.py);
this starts Debian's `prometheus` against the real stack's `/metrics` with the repository's
alert rules (deploy/prometheus/wim-alerts.yaml), drives the README's calls and a failover,
and asks Prometheus' HTTP API what a Grafana and an Alertmanager would see: every dashboard
query returns data (zero where nothing happened, not "No data"), every rule loads and
evaluates, and the failover's alert fires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.test_deploy_observability import ALERTS, REQUIRED_ALERTS, dashboard_exprs
from tests.harness.live_stack import (
    MAIN,
    OPTIONS,
    PORT,
    QUERY,
    LiveStack,
    metric,
    query_body,
    wait_for,
)
from tests.harness.prometheus_server import JOB, PrometheusServer, prometheus_binary
from tests.live.test_serving import open_document, serving

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]

LIVE_APP = MAIN
# Above the router's metrics_interval_s (default 1 s): a scrape waits for a page rendered
# after it arrived.
SCRAPE_S = 2.0
FAILOVERS = f'wim_session_failover_total{{job="{JOB}", reason="session_missing"}}'


@pytest.fixture
def client(live_stack: LiveStack) -> Iterator[httpx.Client]:
    yield from serving(live_stack, engines=2)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(
        prometheus_binary(), tmp_path, f"127.0.0.1:{PORT}", ALERTS.resolve(), SCRAPE_S
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def readme_calls(client: httpx.Client, report: str) -> str:
    """The README's three ways in: a one-shot `POST /wim`, a document session and a query on
    it, an OpenAI chat completion. Returns the document's id."""
    one_shot = client.post("/wim", json={"context": report, "query": QUERY, "options": OPTIONS})
    assert one_shot.status_code == 200, one_shot.text
    document = open_document(client, report)
    asked = client.post("/wim", json=query_body(document["document_id"]))
    assert asked.status_code == 200, asked.text
    model = client.get("/v1/models").json()["data"][0]["id"]
    chat = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert chat.status_code == 200, chat.text
    return str(document["document_id"])


def fail_over(client: httpx.Client, document_id: str) -> None:
    """The document's replica forgets its session (as a restarted replica does); the next
    query finds it missing and reads the document again (`session_missing`)."""
    from ray import serve

    engines = serve.get_deployment_handle("EngineReplica", app_name="wim")
    before = metric(client, "wim_session_failover_total", reason="session_missing")
    # Serve routes each call to either replica; the one without the session says False.
    wait_for(
        lambda: engines.close_document.remote(document_id).result(timeout_s=60),
        "the replica holding the document to close it",
        120,
    )
    asked = client.post("/wim", json=query_body(document_id))
    assert asked.status_code == 200, asked.text
    assert metric(client, "wim_session_failover_total", reason="session_missing") == before + 1


def until_none(problems: Callable[[], Any], what: str, timeout: float) -> None:
    """Polls `problems()` until it finds none; fails naming the last ones found."""
    last: Any = None

    def none_left() -> bool:
        nonlocal last
        last = problems()
        return not last

    try:
        wait_for(none_left, what, timeout, errors=())
    except pytest.fail.Exception:
        pytest.fail(f"{what}: still {last}")


def empty_panels(prometheus: PrometheusServer) -> list[str]:
    """The dashboard's queries that answer nothing (Grafana's "No data")."""
    return [f"{title}: {expr}" for title, expr in dashboard_exprs() if not prometheus.query(expr)]


def rules_not_evaluated(prometheus: PrometheusServer) -> dict[str, Any]:
    """Alert rules that are missing, unhealthy or not evaluated yet, with what Prometheus
    says of each."""
    rules = {
        rule["name"]: rule
        for group in prometheus.get("/api/v1/rules")["groups"]
        for rule in group["rules"]
    }
    pending = {name: "not loaded" for name in REQUIRED_ALERTS - set(rules)}
    for name, rule in rules.items():
        if rule["health"] != "ok" or rule["lastEvaluation"].startswith("0001-"):
            pending[name] = {key: rule.get(key) for key in ("health", "lastError")}
    return pending


def firing(prometheus: PrometheusServer) -> set[str]:
    return {
        alert["labels"]["alertname"]
        for alert in prometheus.get("/api/v1/alerts")["alerts"]
        if alert["state"] == "firing"
    }


def test_every_panel_has_data_every_rule_evaluates_and_a_failover_fires(
    client: httpx.Client, prometheus: PrometheusServer, report: str
) -> None:
    # The failover counter is scraped at 0 before it moves: `increase()` sees the step.
    wait_for(
        lambda: prometheus.query(f"count_over_time({FAILOVERS}[1m]) >= 2"),
        "two scrapes of the failover counter",
        120,
    )
    assert not firing(prometheus) & {"WiMSessionFailovers", "WiMServiceDown"}
    document_id = readme_calls(client, report)
    try:
        fail_over(client, document_id)
        wait_for(lambda: prometheus.query(f"{FAILOVERS} >= 1"), "the failover scraped", 120)
        # A rate needs two scrapes in its window after the calls: poll until all answer.
        until_none(lambda: empty_panels(prometheus), "panels without data", 60)
    finally:
        assert client.delete(f"/documents/{document_id}").status_code == 204
    server_errors = next(expr for title, expr in dashboard_exprs() if title == "Server errors")
    assert [float(s["value"][1]) for s in prometheus.query(server_errors)] == [0.0]
    until_none(lambda: rules_not_evaluated(prometheus), "rules not evaluated", 60)
    wait_for(lambda: "WiMSessionFailovers" in firing(prometheus), "the failover alert", 60)
