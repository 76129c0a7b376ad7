"""The multi-host deployment of docs/deploy.md ("Several hosts: a bare Ray cluster") as the
multi-node harness (tests/harness/multinode.py) brings it up: each host's `ray start`
environment (steps 2 to 5 there) and `deploy/serve_config_multinode.yaml` itself, changed only
where a cluster of five nodes on one machine must differ; each change says why.

tests/deploy/test_multinode_bringup.py keeps docs/deploy.md and the serve config's bring-up
comments in step with what is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.harness.live_stack import kv_store_env
from wim_service.serving.store.redis_store import REDIS_URL_ENV
from wim_service.serving.tenants import KEYS_FILE_ENV

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "deploy" / "serve_config_multinode.yaml"
# The resources that place replicas on purpose (the config and the Helm chart ask for them).
ENGINE_HOST = "wim_engine_host"
ROUTER_HOST = "wim_router_host"
# Steps 4 and 5: how long a worker host's raylet, and every replica on it, wait for a lost GCS
# before they exit. Ray's default (60 s) ends the whole cluster when a head stays away longer.
RECONNECT_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
RECONNECT_TIMEOUT_S = 600
# Step 2: Ray's token authentication on every host.
TOKEN_AUTH = {"RAY_AUTH_MODE": "token"}
EVERY_HOST = {
    "RAY_worker_niceness": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # A call already sent to a node cut off the network fails within seconds (docs/deploy.md,
    # "Deadlines"): the router partition's requests are cut and retried, not held for minutes.
    "RAY_grpc_client_keepalive_time_ms": "5000",
    "RAY_grpc_client_keepalive_timeout_ms": "5000",
}
# What a test cluster on one shared machine needs beyond the documented deployment.
TEST_CLUSTER = {
    # Ray kills actors when the *machine* passes 95% memory; other tests' engines count too.
    "RAY_memory_monitor_refresh_ms": "0",
    # The GCS declares a node dead after `failure_threshold` failed health checks, one every
    # `period`, each failing after `timeout`: Ray's defaults (5 x 3 s, 10 s each) keep an
    # unreachable node's replicas in the routing set for up to a minute, and every scenario
    # that loses a node would wait that long before the cluster is whole again.
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def host_env(role: str, token: str, redis_url: str, keys_file: Path) -> dict[str, str]:
    """The environment docs/deploy.md gives `ray start` on a host of `role` (head, engine or
    router), plus `TEST_CLUSTER`. The head's GCS fault tolerance (step 3) needs the Redis
    address apart from its URL: the harness adds it."""
    env = {**EVERY_HOST, **TOKEN_AUTH, "RAY_AUTH_TOKEN": token, **TEST_CLUSTER}
    if role == "head":
        return env
    env[RECONNECT_TIMEOUT_ENV] = str(RECONNECT_TIMEOUT_S)
    # Documents' KV in the same Redis as the sessions (docs/deploy.md, "Stored document KV"),
    # bounded to 1 GiB, not the default 8: the machine's memory is shared.
    env.update(kv_store_env(redis_url))
    if role == "router":
        env[REDIS_URL_ENV] = redis_url
        env[KEYS_FILE_ENV] = str(keys_file)
    return env


def serve_config(*, router_memory: int | None = None) -> dict[str, Any]:
    """`deploy/serve_config_multinode.yaml` as it is; with `router_memory`, a router actor
    option that replaces the routers alone (a rollout, as an operator's redeploy makes)."""
    config: dict[str, Any] = yaml.safe_load(SERVE_CONFIG.read_text())
    (app,) = config["applications"]
    deployments = {deployment["name"]: deployment for deployment in app["deployments"]}
    if router_memory is not None:
        deployments["WiMRouter"]["ray_actor_options"]["memory"] = router_memory
    return config
