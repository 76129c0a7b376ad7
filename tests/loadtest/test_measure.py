"""loadtest/measure.py without a service: its summary from fixture CSVs, its Serve config, its
options and its run of Locust into its folder."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.loadtest.test_deploy_loadtest import (
    LOADTEST,
    ROOT,
    StubService,
    serve,
    stub,  # noqa: F401
)

FIXTURES = ROOT / "tests" / "data" / "loadtest"


@pytest.fixture
def measure(monkeypatch: pytest.MonkeyPatch) -> Any:
    """loadtest/measure.py as a module (it imports its neighbours by their plain names)."""
    monkeypatch.syspath_prepend(str(LOADTEST))
    return importlib.import_module("measure")


def test_the_summary_reports_rates_latencies_failures_and_kv(measure: Any) -> None:
    run = measure.Run(
        replicas=2,
        users=4,
        rate=0.05,
        seconds=300,
        startup_s=95.2,
        commands=[".venv/bin/python loadtest/measure.py --replicas 2 --out /tmp/r2"],
        loads={"at the load's start": "load average: 1.10, 0.90, 0.80"},
        nproc=2,
        settled=True,
        locust_status=1,
    )
    summary = measure.summarize(FIXTURES, run)
    assert summary.startswith("# Load test: 2 engine replicas, 4 users at 0.05 questions/s each")
    assert "ready after 95 s; load for 300 s; `nproc` 2" in summary
    assert "- at the load's start: `load average: 1.10, 0.90, 0.80`" in summary
    # Offered: one user of each weight share x 0.05/s; p50/p95/p99 in seconds.
    assert (
        "| POST | `/wim one-shot` | 15 | 0 | 0.050 | 0.050 | 0.050 | 9.50 | 16.00 | 16.00 |"
        in summary
    )
    assert (
        "| POST | `/wim session` | 27 | 3 | 0.090 | 0.080 | 0.100 | 2.30 | 4.80 | 6.10 |" in summary
    )
    assert (
        "| POST | `/v1/chat/completions` | 14 | 2 | 0.047 | 0.040 | 0.050 | 9.80 | 15.00 | 15.00 |"
        in (summary)
    )
    assert "| POST | `/documents` | 8 | 1 | 0.027 | 0.023 | - | 4.10 | 7.10 | 7.10 |" in summary
    assert "Aggregated" not in summary  # Locust's own total counts the TTFM marks as requests
    assert "offered 0.200/s (4 users x 0.05/s), sent 0.187/s, answered 0.170/s" in summary
    assert "| `/wim one-shot` | 15 | 3.10 | 5.90 | 5.90 |" in summary  # time to first margin
    assert "| `/wim session` | 24 | 0.90 | 1.90 | 2.10 |" in summary
    assert "| POST | `/documents` | 429 overloaded | 1 | yes |" in summary
    assert "| POST | `/v1/chat/completions` | 503 unavailable | 2 | yes |" in summary
    assert "| POST | `/wim session` | error event: engine_error | 2 | **no** |" in summary
    assert "4 samples of `GET /metrics`" in summary
    assert "| `wim_sessions_active` | 4 | 2 |" in summary
    assert "| `wim_kv_reserved_blocks` | 120 | 60 |" in summary
    assert "| `vllm_kv_cache_usage_perc` | 0.4 | 0.2 |" in summary
    assert "| `replicas` | 1 | 1 |" in summary
    assert "(no session, no reserved KV): yes" in summary
    assert "--replicas 2 --out /tmp/r2" in summary
    unexpected = [row["Error"] for row in measure.unexpected_failures(FIXTURES)]
    assert unexpected == [
        "CatchResponseError('error event: engine_error')",
        "CatchResponseError('stream ended without a done event')",
    ]


def test_the_serve_config_has_fixed_replicas_on_loopback(measure: Any, tmp_path: Path) -> None:
    path = tmp_path / "serve_config.yaml"
    measure.write_config(path, 8770, 2)
    config = yaml.safe_load(path.read_text())
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8770}
    engines = {d["name"]: d for d in config["applications"][0]["deployments"]}["EngineReplica"]
    assert engines["num_replicas"] == 2
    assert "autoscaling_config" not in engines


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--users", "6"], "--users must be a positive multiple of 4"),
        (["--minutes", "31"], "--minutes must be in (0, 30]"),
        (["--rate", "0"], "--rate must be in (0, 100] per second"),
        (["--replicas", "3"], "argument --replicas: invalid choice: 3"),
    ],
)
def test_measure_refuses_bad_options_before_starting_anything(
    measure: Any, options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        measure.parse_args(["--replicas", "1", "--out", "/tmp/unused", *options])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_measure_refuses_a_port_in_use(
    measure: Any,
    stub: tuple[str, type[StubService]],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = stub[0].rsplit(":", 1)[1]
    with pytest.raises(SystemExit):
        measure.parse_args(["--replicas", "1", "--out", "/tmp/unused", "--port", port])
    assert f"something already listens on 127.0.0.1:{port}" in capsys.readouterr().err


def test_measure_help() -> None:
    result = subprocess.run(
        [sys.executable, "loadtest/measure.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "--replicas {1,2}" in result.stdout


def test_measure_runs_locust_into_its_folder_and_summarizes(
    measure: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """measure.py's whole run, with a stub in place of the service it would start."""
    with serve(StubService) as (url, served):
        monkeypatch.setattr(measure, "port_taken", lambda port: False)
        # A stand-in that stops on SIGINT as `wim serve` does, whatever the suite inherited: a
        # shell's background job (`./test.sh &`) ignores SIGINT, and so would a plain `sleep`.
        stand_in = (
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(60)"
        )
        monkeypatch.setattr(
            measure,
            "start_service",
            lambda config, log: subprocess.Popen([sys.executable, "-c", stand_in]),
        )
        monkeypatch.setattr(measure, "wait_ready", lambda client, replicas, timeout_s: None)
        monkeypatch.setattr(measure, "SETTLE_TIMEOUT_S", 1)
        port = url.rsplit(":", 1)[1]
        options = ["--out", str(tmp_path), "--port", port, "--minutes", "0.1", "--rate", "1"]
        status = measure.main(["--replicas", "2", *options])
    assert status == 1  # the stub's gauges keep 3 sessions: not settled
    for name in ("locust_stats.csv", "locust_failures.csv", "report.html", "metrics.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    serve_config = yaml.safe_load((tmp_path / "serve_config.yaml").read_text())
    assert serve_config["http_options"]["port"] == int(port)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Load test: 2 engine replicas, 4 users at 1 questions/s each")
    assert "| POST | `/wim session` |" in summary
    assert "| `/wim one-shot` |" in summary.split("## Time to first margin")[1]
    assert "## Failures by reason\n\nNone." in summary
    assert "| `wim_kv_reserved_blocks` | 42 | 42 |" in summary
    assert "(no session, no reserved KV): **no**" in summary
    assert f"--host http://127.0.0.1:{port} --users 4 --spawn-rate 4 --run-time 6s" in summary
    assert "before the service started: `" in summary and "load average" in summary
    assert "GET /metrics" in served.requests
