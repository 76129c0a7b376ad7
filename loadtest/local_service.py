"""The service on this machine for the load tools (soak.py, measure.py, the locustfile's metrics
sampler): start it on loopback with fixed engine replicas, wait for it, read its /metrics.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

ROOT = Path(__file__).resolve().parent.parent

# The columns of a /metrics snapshot (`snapshot`), after `time` and `elapsed_s`.
SNAPSHOT_COLUMNS = (
    "replicas",  # engine replicas whose vLLM metrics the router gathered
    "wim_sessions_active",
    "wim_kv_reserved_blocks",
    "wim_session_resident_kv_tokens",
    "wim_replica_draining",
    "vllm_kv_cache_usage_perc",  # mean over the replicas (equal KV pools)
    "vllm_num_requests_running",
    "vllm_num_requests_waiting",
)
# Gauges summed over their labels (replicas), by column.
_SUMMED = {
    "wim_sessions_active": "wim_sessions_active",
    "wim_kv_reserved_blocks": "wim_kv_reserved_blocks",
    "wim_session_resident_kv_tokens": "wim_session_resident_kv_tokens",
    "wim_replica_draining": "wim_replica_draining",
    "vllm_num_requests_running": "vllm:num_requests_running",
    "vllm_num_requests_waiting": "vllm:num_requests_waiting",
}


# -- the service ---------------------------------------------------------------------------


def serve_config() -> dict[str, Any]:
    """deploy/serve_config.yaml, parsed."""
    return yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())


def write_config(
    path: Path,
    port: int,
    replicas: int,
    router: Mapping[str, Any] | None = None,
    engine: Mapping[str, Any] | None = None,
) -> None:
    """deploy/serve_config.yaml on 127.0.0.1:`port` with `replicas` engines and no autoscaling
    (so that runs with one and two replicas compare), `router` and `engine` over its
    `args.router` and `args.engine`."""
    config = serve_config()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["router"].update(router or {})
    args["engine"].update(engine or {})
    for deployment in config["applications"][0]["deployments"]:
        if deployment["name"] == "EngineReplica":
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = replicas
    path.write_text(yaml.safe_dump(config))


def start_service(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`wim serve` on `config` (see `write_config`), its output in `log`."""
    wim = Path(sys.executable).with_name("wim")
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(wim), "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one at the end
        )


def stop_service(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)  # `serve run` shuts Serve and its Ray down
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def wait_ready(client: httpx.Client, replicas: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = client.get("/readyz")
            if response.status_code == 200 and len(response.json()["replicas"]) >= replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"the service was not ready within {timeout_s:g} s")


# -- /metrics ------------------------------------------------------------------------------


def _samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


def total(text: str, name: str) -> float:
    """The sum of a metric's samples over all their labels."""
    return sum(sample.value for sample in _samples(text) if sample.name == name)


def snapshot(text: str) -> dict[str, float]:
    """The `SNAPSHOT_COLUMNS` of one /metrics text: sessions, KV use and requests over all
    replicas."""
    samples = list(_samples(text))
    row = {
        column: sum(s.value for s in samples if s.name == name) for column, name in _SUMMED.items()
    }
    usage = [s.value for s in samples if s.name == "vllm:kv_cache_usage_perc"]
    row["vllm_kv_cache_usage_perc"] = fmean(usage) if usage else 0.0
    replicas = {s.labels.get("replica") for s in samples if s.name.startswith("vllm:")}
    row["replicas"] = len(replicas - {None})
    return row


def metric(client: httpx.Client, name: str) -> float:
    return total(client.get("/metrics").text, name)


def settled(client: httpx.Client, timeout_s: float) -> bool:
    """No session and no reserved KV on any replica within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(client, "wim_sessions_active") == 0 == metric(client, "wim_kv_reserved_blocks"):
            return True
        time.sleep(1)
    return False
