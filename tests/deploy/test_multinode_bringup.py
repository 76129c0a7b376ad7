"""The multi-host bring-up is written in three places that must agree: docs/deploy.md (the
steps an operator follows), `deploy/serve_config_multinode.yaml`'s comments (the same steps in
brief) and the multi-node harness, which starts its nodes and deploys the config as those
steps do (tests/harness/multinode_deploy.py), so that the fault suite measures the documented
deployment."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.harness.multinode_deploy import (
    EVERY_HOST,
    RECONNECT_TIMEOUT_ENV,
    RECONNECT_TIMEOUT_S,
    SERVE_CONFIG,
    TOKEN_AUTH,
    host_env,
    serve_config,
)

DEPLOY_DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
RECONNECT = f"{RECONNECT_TIMEOUT_ENV}={RECONNECT_TIMEOUT_S}"


def bare_cluster_section() -> str:
    text = DEPLOY_DOC.read_text()
    start = text.index("## Several hosts: a bare Ray cluster")
    return text[start : text.index("\n## ", start + 1)]


def config_comments() -> str:
    return "\n".join(line for line in SERVE_CONFIG.read_text().splitlines() if line.startswith("#"))


def ray_starts(text: str, resource: str) -> list[str]:
    """The `ray start` commands of hosts offering `resource`, each with its environment (its
    lines continued by a backslash joined, in a comment too)."""
    commands = re.sub(r"\\\n#?", " ", text).splitlines()
    return [line for line in commands if "ray start" in line and f'"{resource}": 1' in line]


def test_docs_and_config_start_worker_hosts_with_the_harness_reconnect_timeout() -> None:
    for text in (bare_cluster_section(), config_comments()):
        for resource in ("wim_engine_host", "wim_router_host"):
            starts = ray_starts(text, resource)
            assert starts and all(RECONNECT in start for start in starts), (
                resource,
                starts,
            )


def test_docs_and_config_turn_on_the_harness_token_auth() -> None:
    (mode,) = (f"{name}={value}" for name, value in TOKEN_AUTH.items())
    assert f"export {mode} RAY_AUTH_TOKEN=" in bare_cluster_section()
    assert f"export {mode} RAY_AUTH_TOKEN=" in config_comments()
    for name, value in EVERY_HOST.items():
        assert f"{name}={value}" in bare_cluster_section(), name


def test_the_harness_starts_hosts_as_documented(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    url = "redis://:secret@10.77.1.254:6380/0"
    head = host_env("head", "TOKEN", url, keys)
    engine = host_env("engine", "TOKEN", url, keys)
    router = host_env("router", "TOKEN", url, keys)
    for env in (head, engine, router):
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "TOKEN"
    # The head keeps Ray's default, as docs/deploy.md's step 3 does.
    assert RECONNECT_TIMEOUT_ENV not in head
    assert engine[RECONNECT_TIMEOUT_ENV] == router[RECONNECT_TIMEOUT_ENV] == "600"
    assert router["WIM_REDIS_URL"] == url and router["WIM_API_KEYS_FILE"] == str(keys)
    assert "WIM_REDIS_URL" not in engine
    assert engine["WIM_KV_STORE"] == router["WIM_KV_STORE"] == url


def test_the_harness_deploys_the_config_file_itself() -> None:
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    assert serve_config() == config
    assert config["proxy_location"] == "EveryNode"
    replaced = serve_config(router_memory=2**20)
    (app,) = replaced["applications"]
    router, engine = app["deployments"]
    assert router["ray_actor_options"]["memory"] == 2**20
    assert engine == config["applications"][0]["deployments"][1]
