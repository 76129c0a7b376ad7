"""Every command that starts an engine ends its whole process tree within 10 s of SIGTERM or
SIGINT: the command, vLLM's EngineCore and its worker, and for `wim serve` Ray's own processes
(gcs_server, raylet, its workers and their engines).

Each test starts the console script in its own process group on the default model, as small
as the command allows, waits for its EngineCore, signals the command's process alone (as
`kill PID` does) and records every process the tree ever had (tests/harness/process_tree.py). The
signal reaches `wim run` and `wim serve` while their engine still loads (the command blocked
in vLLM's start-up), `wim eval` and `wim bench` once their engine works. SIGTERM and SIGINT
are each sent to two commands.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.process_tree import ProcessTree, is_engine_core

WIM = str(Path(sys.executable).with_name("wim"))
ROOT = Path(__file__).resolve().parents[2]
# What the tests ask of the commands: an exit this long after the signal.
WITHIN_S = 10.0
# Engines take ~30 s to start on an idle machine; Ray Serve's first replica ~60 s.
START_TIMEOUT_S = 240.0
# The smallest engine the default model runs with.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25"]
DOCUMENT = (
    "The night gate of the harbour office opens with code 4417. The day gate has no code. "
    "Deliveries arrive on Tuesdays and leave on Thursdays."
)
QUERY = "What is the code of the night gate?"
SERVE_PORT = 8771

pytestmark = [pytest.mark.engine, pytest.mark.timeout(int(START_TIMEOUT_S + 60))]


def _serve_config(path: Path) -> Path:
    """deploy/serve_config.yaml on a port of its own, with one small engine replica."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": SERVE_PORT}
    application = config["applications"][0]
    application["args"]["engine"].update(dtype="float32", max_model_len=2048, kv_cache_gib=0.25)
    for deployment in application["deployments"]:
        if deployment["name"] == "EngineReplica":
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = 1
    path.write_text(yaml.safe_dump(config))
    return path


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
    if name == "bench":
        return [
            WIM, "bench", "--context", str(document), "--repeat", "1", "--rounds", "1",
            "--concurrency", "1", "--skip-reference", *ENGINE_FLAGS,
        ]  # fmt: skip
    return [WIM, "serve", "--config", str(_serve_config(tmp / "serve_config.yaml"))]


@pytest.mark.parametrize(
    ("command", "signum", "working"),
    [
        # While the engine loads (run, bench) and once it is up (eval). The suite's time
        # allows one engine-up case: each costs an engine start and a job.
        ("run", signal.SIGTERM, None),
        ("eval", signal.SIGTERM, "tasks x"),  # its first output once the engine is up
        ("bench", signal.SIGINT, None),
        pytest.param("serve", signal.SIGINT, None, marks=pytest.mark.serving),
    ],
)
def test_signal_ends_the_whole_process_tree(
    command: str, signum: signal.Signals, working: str | None, tmp_path: Path
) -> None:
    # A Ray cluster of its own, even where another one runs on the machine.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    tree = ProcessTree(_command(command, tmp_path), tmp_path / "output.log", env)
    try:
        tree.wait_for(lambda running: any(map(is_engine_core, running)), START_TIMEOUT_S)
        if working is not None:
            tree.wait_for(lambda _: tree.printed(working), START_TIMEOUT_S)
        took = tree.stop(signum, WITHIN_S)
        print(f"wim {command}: every process ended {took:.1f} s after {signum.name}")
        assert tree.root.returncode == 128 + signum, tree.output()
    finally:
        tree.kill()
