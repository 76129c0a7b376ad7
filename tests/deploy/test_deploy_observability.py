"""Alert rules (deploy/prometheus) and the Grafana dashboard (deploy/grafana).

Every PromQL expression is parsed (PyPI promql-parser) and may only name metrics the service
exports: `METRIC_NAMES` (histograms with their `_bucket`/`_sum`/`_count` series), vLLM's own
`vllm:*` families as vLLM 0.32 defines them, and Prometheus' `up`. promtool (Debian package
`prometheus`) checks and unit-tests the rules.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.harness.system_tools import system_tool
from wim_service.serving.observability.metrics import METRIC_NAMES, StoredKVMetrics, WiMMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "wim-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "wim-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "wim-service-dashboard.json"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# Grafana's variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$job": "wim-service", "$namespace": ".*"}
REQUIRED_ALERTS = {
    "WiMServiceDown",
    "WiMNoReadyEngine",
    "WiMHighServerErrorRate",
    "WiMHighOverloadRate",
    "WiMKVCacheNearlyFull",
    "WiMSessionFailovers",
    "WiMQueryTTFTHigh",
    "WiMEventLoopStalled",
    "WiMMaintenanceFailing",
}
VLLM_METRICS_USED_BY_THE_DASHBOARD = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
}


def wim_series() -> set[str]:
    """Series names the service's own metrics appear under."""
    replica = CollectorRegistry()
    StoredKVMetrics(replica)  # an engine replica's own, merged into the router's /metrics
    histograms = {
        family.name
        for registry in (WiMMetrics().registry, replica)
        for family in registry.collect()
        if family.type == "histogram"
    }
    assert histograms <= set(METRIC_NAMES)
    return set(METRIC_NAMES) | {h + s for h in histograms for s in HISTOGRAM_SERIES}


def vllm_series() -> set[str]:
    """Series names of the `vllm:*` families vLLM's Prometheus logger defines (read from the
    installed source; importing vLLM is slow)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations)), "v1", "metrics", "loggers.py")
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": HISTOGRAM_SERIES}
    found = re.findall(
        r'self\._(counter|gauge|histogram)_cls\(\s*name="(vllm:\w+)"', source.read_text()
    )
    assert len(found) > 20, f"vLLM's metric definitions moved: {source}"
    return {name + suffix for kind, name in found for suffix in suffixes[kind]}


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            yield panel["title"], expr


def test_alert_and_dashboard_queries_name_only_exported_metrics() -> None:
    known = wim_series() | vllm_series() | {"up"}
    queries = [(r["alert"], r["expr"]) for r in alert_rules()] + list(dashboard_exprs())
    for where, expr in queries:
        unknown = metric_names(expr) - known
        assert not unknown, f"{where}: {sorted(unknown)} is not exported"


def test_dashboard_shows_every_wim_metric_and_the_vllm_panels() -> None:
    shown = set().union(*(metric_names(expr) for _, expr in dashboard_exprs()))
    families = {name.removesuffix(s) for name in shown for s in (*HISTOGRAM_SERIES, "")}
    assert set(METRIC_NAMES) <= families
    assert shown >= VLLM_METRICS_USED_BY_THE_DASHBOARD


def test_dashboard_is_importable_grafana_json() -> None:
    board = dashboard()
    assert board["uid"] == "wim-service"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
            for target in panel["targets"]:
                assert 'job="$job"' in target["expr"] and "$namespace" in target["expr"]


def test_alert_rules_cover_the_required_conditions() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(rules) == REQUIRED_ALERTS
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])
        assert 'job="wim-service"' in rule["expr"]


@pytest.fixture(scope="module")
def promtool() -> str:
    return system_tool("promtool", "prometheus", "check the alert rules with promtool")


def run_promtool(promtool: str, *args: str) -> None:
    result = subprocess.run(
        [promtool, *args], cwd=ALERTS.parent, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_rules(promtool: str) -> None:
    run_promtool(promtool, "check", "rules", ALERTS.name)


def test_promtool_unit_tests_the_alerts(promtool: str) -> None:
    run_promtool(promtool, "test", "rules", ALERT_TESTS.name)
