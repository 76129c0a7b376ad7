"""Every command that starts an engine ends its whole process tree within 10 s of SIGTERM or
SIGINT: the command, vLLM's EngineCore (its worker in the same process), and for `wim serve`
Ray's own processes (gcs_server, raylet, its workers and their engines).

Each test starts the console script in its own process group on the default model, as small
as the command allows, waits for its EngineCore, signals the command's process alone (as
`kill PID` does) and records every process the tree ever had (tests/harness/process_tree.py). The
signal reaches `wim run` and `wim serve` while their engine still loads (the command blocked
in vLLM's start-up), `wim eval` once its engine works: SIGINT the first two, SIGTERM the last.
A `wim serve` that answered a request is stopped by Ctrl-C too, after what `./run.sh` prints
while it runs is checked. Every other command that starts an engine (`wim bench`,
`wim calibrate`) stops through the same `run_command` as `wim run` and `wim eval`
(wim_service/cli/lifecycle.py), whose handling of both signals tests/cli/test_cli.py checks
without an engine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import OWN_ENGINE_CORE
from tests.harness.process_tree import ProcessTree, is_engine_core

WIM = str(Path(sys.executable).with_name("wim"))
ROOT = Path(__file__).resolve().parents[2]
# What the tests ask of the commands: an exit this long after the signal.
WITHIN_S = 10.0
# Engines take ~30 s to start on an idle machine; Ray Serve's first replica ~60 s.
START_TIMEOUT_S = 240.0
# The smallest engine the default model runs with, on the own-process engines' core.
ENGINE_FLAGS = [
    *("--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25"),
    *("--cpu-threads-bind", OWN_ENGINE_CORE),
]
DOCUMENT = (
    "The night gate of the harbour office opens with code 4417. The day gate has no code. "
    "Deliveries arrive on Tuesdays and leave on Thursdays."
)
QUERY = "What is the code of the night gate?"
SERVE_PORT = 8771

# Ray waits a fixed 30 s for the raylet that `serve run` starts to register with its GCS
# (ray/_private/node.py, not configurable), and on two cores busy with the cluster's tests that
# ran out twice: Ray's start, not `wim serve`, failed. Such a start is tried once more.
RAY_START_TIMED_OUT = "The current node timed out during startup"

pytestmark = [pytest.mark.engine, pytest.mark.timeout(int(2 * START_TIMEOUT_S + 60))]


def _serve_config(path: Path) -> Path:
    """deploy/serve_config.yaml on a port of its own, with one small engine replica."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": SERVE_PORT}
    application = config["applications"][0]
    application["args"]["engine"].update(
        dtype="float32", max_model_len=2048, kv_cache_gib=0.25, cpu_threads_bind=OWN_ENGINE_CORE
    )
    for deployment in application["deployments"]:
        if deployment["name"] == "EngineReplica":
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = 1
    path.write_text(yaml.safe_dump(config))
    return path


def _started(
    name: str, tmp: Path, until: Callable[[ProcessTree, list[psutil.Process]], bool]
) -> ProcessTree:
    """The command `name` started in a Ray cluster of its own (even where another one runs on
    the machine) and run until `until` holds; started twice if Ray's own start timed out."""
    env = {**os.environ, "RAY_ADDRESS": "local"}
    attempt = 1
    while True:
        tree = ProcessTree(_command(name, tmp), tmp / f"output-{attempt}.log", env)
        try:
            tree.wait_for(lambda running, tree=tree: until(tree, running), START_TIMEOUT_S)
            return tree
        except AssertionError:
            tree.kill()
            if attempt == 2 or not tree.printed(RAY_START_TIMED_OUT):
                raise
        print(f"wim {name}: Ray's start timed out; started again")
        attempt += 1


def _command(name: str, tmp: Path) -> list[str]:
    document = tmp / "document.txt"
    document.write_text(DOCUMENT)
    if name == "run":
        return [WIM, "run", "--context", str(document), "--query", QUERY, *ENGINE_FLAGS]
    if name == "eval":
        return [
            WIM, "eval", "--lengths", "256", "--samples", "1", "--kinds", "needle",
            "--methods", "plain", "wim_none", "--out", str(tmp / "eval"), *ENGINE_FLAGS,
        ]  # fmt: skip
    return [WIM, "serve", "--config", str(_serve_config(tmp / "serve_config.yaml"))]


@pytest.mark.parametrize(
    ("command", "signum", "working"),
    [
        # While the engine loads (run, serve) and once it is up (eval). The suite's time
        # allows one case of each: each costs an engine start. Each starts what it runs, so
        # all run on the cluster tests' worker (`own_engines`), beside the shared engine's.
        pytest.param("run", signal.SIGINT, None, marks=pytest.mark.own_engines),
        pytest.param("eval", signal.SIGTERM, "tasks x", marks=pytest.mark.own_engines),
        pytest.param(
            "serve", signal.SIGINT, None, marks=[pytest.mark.serving, pytest.mark.own_engines]
        ),
    ],
)
def test_signal_ends_the_whole_process_tree(
    command: str, signum: signal.Signals, working: str | None, tmp_path: Path
) -> None:
    tree = _started(command, tmp_path, lambda _, running: any(map(is_engine_core, running)))
    try:
        if working is not None:
            tree.wait_for(lambda _: tree.printed(working), START_TIMEOUT_S)
        took = tree.stop(signum, WITHIN_S)
        print(f"wim {command}: every process ended {took:.1f} s after {signum.name}")
        assert tree.root.returncode == 128 + signum, tree.output()
    finally:
        tree.kill()


# Serve's access lines of what the service calls on its own: the router's polls of each engine
# replica, a scrape and its fan-out, the readiness probe (serving/observability/logs.py).
ROUTINE_LINES = (
    "CALL load ",
    "CALL claim ",
    "CALL metrics_text ",
    "GET /metrics ",
    "GET /readyz 200",
    "GET /healthz ",
)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return int(answer.status)


@pytest.mark.serving
@pytest.mark.own_engines
@pytest.mark.timeout(int(4 * START_TIMEOUT_S))  # a start (or two), a request, a stop
def test_serve_prints_requests_not_its_own_calls_and_ctrl_c_one_line(tmp_path: Path) -> None:
    """What `./run.sh` prints: after its ready line, no line per poll of the router (two per
    engine replica every poll) or per scrape, but the request; and a Ctrl-C that ends with
    `wim: stopped by SIGINT` alone, no thread dump, although Serve's own stop outlasts the
    watchdog's grace (lifecycle.py)."""
    tree = _started("serve", tmp_path, lambda tree, _: tree.printed("wim_service ready at"))
    url = f"http://127.0.0.1:{SERVE_PORT}"
    try:
        # Ready means the router had a load report: the replica had answered `load` polls.
        assert _get(url + "/metrics") == 200 and _get(url + "/healthz") == 200
        body = json.dumps({"context": DOCUMENT, "query": QUERY}).encode()
        request = urllib.request.Request(
            url + "/wim", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=START_TIMEOUT_S) as answer:
            assert answer.status == 200 and json.load(answer)["answer"]
        # Each replica's lines come in its order: the router's line of the request after its
        # scrape's and probe's, the engine replica's after its polls' (which came first).
        tree.wait_for(
            lambda _: tree.printed("POST /wim 200") and tree.printed("CALL run OK"),
            START_TIMEOUT_S,
        )
        running = tree.log.read_text(errors="replace")
        after_ready = running[running.index("wim_service ready at") :]
        assert [line for line in ROUTINE_LINES if line in after_ready] == [], after_ready[-3000:]

        tree.stop(signal.SIGINT, WITHIN_S)
        assert tree.root.returncode == 128 + signal.SIGINT, tree.output()
        stopping = tree.log.read_text(errors="replace")[len(running) :]
        ours = [line for line in stopping.splitlines() if line.startswith("wim")]
        assert ours == ["wim: stopped by SIGINT"], stopping
        assert "most recent call first" not in stopping, stopping
    finally:
        tree.kill()
