"""A real Prometheus server for tests: its own directory, a free loopback port, one scrape job
named as the alert rules and the dashboard expect (`wim-service`), stopped after use.

The binary comes from the Debian package `prometheus` (scripts/bootstrap.sh installs it as
root, for promtool). Without it the test skips on a developer machine and fails in CI
(`CI=true`): CI must not pass by skipping it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.harness.redis_server import free_port
from tests.harness.system_tools import end, system_tool
from wim_service.engine.lifetime import dies_with_this_thread

JOB = "wim-service"


def prometheus_binary() -> str:
    return system_tool(
        "prometheus", "prometheus", "check the dashboard and alerts on a real Prometheus"
    )


class PrometheusServer:
    def __init__(
        self, binary: str, workdir: Path, target: str, rules: Path, scrape_s: float
    ) -> None:
        """Scrapes `target` (host:port) every `scrape_s` and evaluates `rules` every second."""
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "prometheus.log"
        config = {
            "global": {"evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    # /metrics answers with a page rendered after the scrape arrived: up to
                    # the router's metrics_interval_s later.
                    "scrape_interval": f"{scrape_s:g}s",
                    "scrape_timeout": f"{scrape_s:g}s",
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        """Start and wait until it says it is ready."""
        with self.log.open("wb") as log:  # the child keeps its own copy of the file
            self.process = subprocess.Popen(
                dies_with_this_thread(
                    [
                        self.binary,
                        f"--config.file={self.workdir / 'prometheus.yml'}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ]
                ),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.api.get("/-/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"prometheus did not start on port {self.port}: "
                    + self.log.read_text(errors="replace")
                )
            time.sleep(0.1)

    def get(self, path: str, **params: str) -> Any:
        """The `data` of an HTTP API answer (`/api/v1/...`)."""
        response = self.api.get(path, params=params)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: one entry per series (empty: "No data")."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def stop(self) -> None:
        self.api.close()
        if self.process is None:
            return
        end(self.process)
        self.process = None
