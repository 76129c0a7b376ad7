"""The real stack for end-to-end tests: one local Ray cluster running Ray Serve on 127.0.0.1:8765
for the whole test session, on which each test module deploys the application it needs.

Ray Serve restarts every replica of an application when its `args` or `runtime_env` change
(they are the application's code version), and nothing when only a deployment's replica count
changes. So the two applications differ in their router count alone, and the engines start
once for the session: `MAIN` (one router; sessions in the session's real redis-server, three
tenants' API keys) serves `test_serving.py`, `test_hostile.py`, the replay's and the page's
real-stack tests; `TWO_ROUTERS` (two routers over the same store) serves
`test_serving_store.py`. A module names its application in `LIVE_APP`, and
`tests/conftest.py` runs the tests of each application one after another.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness.interrupt import stop_run_on_sigterm

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"
QUERY = "What is the access code for the night gate?"
OPTIONS = {"segment_tokens": 192, "margin_max_tokens": 16, "answer_max_tokens": 16}
ENGINE = {
    # Whatever the CPU: the same numbers everywhere (bfloat16 is emulated, 6x slower, on CPUs
    # without AVX512-BF16 or AMX).
    "dtype": "float32",
    "max_model_len": 4096,
    # Room for two of the tests' document sessions per replica: after scale-down the survivor
    # must take the leaving replica's session too (float32 KV: 23,000 tokens per GiB).
    "kv_cache_gib": 1.0,
    "block_size": 32,
    "max_num_seqs": 32,
    # Two engines on two cores: one core each.
    "cpu_threads_bind": "rank",
    "max_sessions": 4,
    "admission_timeout_s": 2,
}
ROUTER = {
    "session_ttl_s": 600,
    "load_poll_interval_s": 1.0,
    "replica_wait_s": 240,
    "max_body_bytes": 2**20,
    # Short, so that a test of held bodies ends soon (tests/live/test_edge_live.py).
    "body_timeout_s": 5,
    # Short, so that every streamed answer carries heartbeats between the engines' events
    # (tests/live/test_openai_live.py).
    "stream_heartbeat_s": 0.1,
    # Short, so that cheapest-first admission acts within seconds of the fleet being full
    # (tests/live/test_saturation_live.py); shipped, it waits out a minute and 120 arrivals
    # of being short.
    "cheapest_first_short_s": 2,
    "cheapest_first_window_s": 10,
    "cheapest_first_short_arrivals": 0,
    "cheapest_first_window_arrivals": 0,
    "max_document_chars": 200_000,
    # Every application's sessions in Redis (`LiveStack`'s server): switching between one
    # router and two is then a change of replica count, not of the application's args.
    "store": {"backend": "redis", "key_prefix": "wim-e2e:", "timeout_s": 1.0},
}
# alpha: every capability, limits high enough that only the engines' capacity refuses work.
# beta: small documents only, no document session of its own. gamma: one-shot jobs only, at
# most `GAMMA_OPEN_REQUESTS` requests open at once.
API_KEYS = {name: f"sk-{name}-test" for name in ("alpha", "beta", "gamma")}
GAMMA_OPEN_REQUESTS = 8
TENANTS: dict[str, dict[str, Any]] = {
    "alpha": {
        "concurrent_jobs": 100,
        "requests_per_minute": 100_000,
        "open_documents": 16,
        "open_requests": 1000,
    },
    "beta": {"document_bytes": 50_000, "open_documents": 0, "requests_per_minute": 100_000},
    "gamma": {"requests_per_minute": 100_000, "open_requests": GAMMA_OPEN_REQUESTS},
}
ALLOW = {"gamma": ["jobs"]}
# Engines scale on reserved KV as well as requests (wim_service/serving/replica/autoscaling.py); the
# request target is out of reach, so only parked sessions' KV starts a replica.
AUTOSCALING = {
    "target_ongoing_requests": 100,
    "upscale_delay_s": 1,
    "downscale_delay_s": 600,
    "metrics_interval_s": 1,
    "look_back_period_s": 2,
    "policy": {
        "policy_function": "wim_service.serving.replica.autoscaling:KVAwarePolicy",
        "policy_kwargs": {"target_kv_fraction": 0.5},
    },
}


def auth(tenant: str | None = "alpha") -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[tenant]}"} if tenant else {}


def keys_json() -> str:
    """`WIM_API_KEYS` (as a Kubernetes Secret would set it): every tenant's key, hashed."""
    from wim_service.serving.tenants import hash_key

    tenants = {
        name: {"keys": [hash_key(key)], "limits": TENANTS[name]}
        | ({"allow": ALLOW[name]} if name in ALLOW else {})
        for name, key in API_KEYS.items()
    }
    return json.dumps({"tenants": tenants})


@dataclass(frozen=True)
class LiveApp:
    """One application config: what changes its code version (router args, environment)."""

    name: str
    router: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    routers: int = 1


MAIN = LiveApp("main", ROUTER)
TWO_ROUTERS = LiveApp("two-routers", ROUTER, routers=2)


def query_body(document_id: str) -> dict[str, Any]:
    """A question on a document session, with the tests' short margins and answer."""
    return {"document_id": document_id, "query": QUERY, "options": OPTIONS}


def from_pinned_kv(body: dict, document: dict, block_size: int = ENGINE["block_size"]) -> bool:
    """Answered from the session's KV (its whole blocks of `block_size` tokens, this stack's
    engines' by default, were cached), not a fresh read."""
    whole_blocks = document["context_tokens"] // block_size * block_size
    return body["usage"]["prompt_tokens_cached"] >= whole_blocks


def open_client(tenant: str | None = "alpha", timeout: float = 600) -> httpx.Client:
    return httpx.Client(base_url=BASE, timeout=timeout, headers=auth(tenant))


def wait_for(
    condition: Callable[[], Any],
    what: str,
    timeout: float = 600,
    errors: tuple[type[Exception], ...] = (httpx.TransportError,),
) -> Any:
    """`condition()`'s first true result, polled every 0.5 s; `errors` it raises count as
    "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = condition()
        except errors:
            result = None
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def ready_replicas(client: httpx.Client) -> list[str]:
    response = client.get("/readyz")
    return response.json()["replicas"] if response.status_code == 200 else []


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """Sum of a metric's samples matching `labels` in GET /metrics."""
    return metric_in(client.get("/metrics").text, name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples matching `labels` in the Prometheus text `text`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled(client: httpx.Client) -> bool:
    """The replicas report (their gauges are there) no session and no KV reservation."""
    # One page: the router renders at most one per `metrics_interval_s`.
    text = client.get("/metrics").text
    return (
        "wim_kv_reserved_blocks{" in text
        and metric_in(text, "wim_sessions_active") == 0
        and metric_in(text, "wim_kv_reserved_blocks") == 0
    )


def session_logs() -> Path:
    """This Ray cluster's own session's log folder (not Ray's newest session's)."""
    import ray

    return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"


def serve_log_failures(limit: int = 40) -> str:
    """The last failure lines of this Ray session's Serve logs (controller, proxy, replicas):
    why a request got a bare 500 from Serve's proxy (an actor that died, a health check)."""
    serve_logs = session_logs() / "serve"
    marks = ("Request failed", "Traceback", "ERROR", "died", "unhealthy", "Error")
    lines = [
        f"{path.name}: {line.rstrip()}"
        for path in sorted(serve_logs.glob("*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if any(mark in line for mark in marks)
    ]
    return "\n".join(lines[-limit:])


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """Events of a whole SSE body (split only at blank lines, whatever the chunking was)."""
    events = []
    for frame in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


# The stored KV's master key in the tests (a deployment takes it from a Secret).
KV_MASTER_KEY = base64.b64encode(bytes(range(32))).decode()


def kv_store_env(url: str) -> dict[str, str]:
    """Documents' KV saved in `url` (engine/kv_transfer), bounded to 1 GiB: a 3,000-token
    document of the default model takes ~140 MB in float32."""
    from wim_service.engine.kv_transfer.documents import MAX_GIB_ENV, STORE_ENV
    from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV

    return {STORE_ENV: url, MASTER_KEY_ENV: KV_MASTER_KEY, MAX_GIB_ENV: "1"}


def application(
    app: LiveApp,
    engines: int,
    max_engines: int | None = None,
    *,
    redis_url: str | None = None,
    engine: dict[str, Any] = ENGINE,
    router_options: dict[str, Any] | None = None,
    engine_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`app` as one application of a serve config, with `engines` engine replicas (up to
    `max_engines` by the KV-aware autoscaler); `router_options` and `engine_options` add to
    the two deployments' settings (actor options, placement)."""
    engine_deployment = {
        "name": "EngineReplica",
        "autoscaling_config": {
            "min_replicas": engines,
            "max_replicas": max_engines or engines,
            **AUTOSCALING,
        },
        **(engine_options or {}),
    }
    router = {"name": "WiMRouter", "num_replicas": app.routers, **(router_options or {})}
    env = {"WIM_API_KEYS": keys_json(), **app.env}
    if redis_url is not None:
        # Sessions and documents' KV in the same Redis, as docs/deploy.md deploys them.
        env["WIM_REDIS_URL"] = redis_url
        env.update(kv_store_env(redis_url))
    return {
        "name": "wim",
        "route_prefix": "/",
        "import_path": "wim_service.serving.app:build_app",
        "args": {"engine": engine, "router": app.router},
        "runtime_env": {"env_vars": env},
        "deployments": [router, engine_deployment],
    }


class LiveStack:
    """Ray and Ray Serve, started once; `deploy` puts an application on them, its sessions in
    the redis-server at `redis_url`."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 (Ray reads this exact name)
        # Ray kills actors when the *machine* passes 95% memory; on a shared machine other
        # processes' memory would kill the controller and proxy mid-test.
        os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112
        import ray
        from ray import serve

        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
        stop_run_on_sigterm()  # ray.init put its own SIGTERM handler in
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        self.deployed: tuple[Any, ...] | None = None

    def deploy(
        self,
        app: LiveApp,
        engines: int,
        max_engines: int | None = None,
        router_actor_options: dict[str, Any] | None = None,
    ) -> None:
        """Deploy `app` as `serve deploy` would, unless it is what runs already, with `engines`
        engine replicas (up to `max_engines` by the KV-aware autoscaler). Engines always run
        under the same autoscaling policy, so that changing their count is a lightweight
        update (the router and its sessions stay); a policy change would restart them all."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        wanted = (app, engines, max_engines, json.dumps(router_actor_options))
        if wanted == self.deployed:
            return
        router = {} if router_actor_options is None else {"ray_actor_options": router_actor_options}
        config = {
            "http_options": {"host": "127.0.0.1", "port": PORT},
            "applications": [
                application(
                    app, engines, max_engines, redis_url=self.redis_url, router_options=router
                )
            ],
        }
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        previous, self.deployed = self.deployed, wanted
        if previous is not None and previous[0] != app:
            # Another application's routers are being replaced: until only this one's run, the
            # proxy may send a request to a router Serve is stopping, and Serve kills it with
            # the request still open (a stream cut short, a bare 500).
            wait_for(lambda: self._routers_settled(app), f"the routers of {app.name}", 900)

    def restart(self, app: LiveApp, engines: int) -> None:
        """Stop the application, routers and engines alike (its sessions and documents' KV
        stay in Redis), then deploy it again: a service restart."""
        from ray import serve

        serve.delete("wim")
        self.deployed = None
        self.deploy(app, engines)

    @staticmethod
    def engines_settled(engines: int) -> bool:
        """Whether Serve runs exactly `engines` engine replicas and starts or stops none. A
        deploy that came while Serve still replaced a killed replica once failed in its
        controller ("Failed to update the deployments"), and the engines' autoscaler never
        acted again: a test that deploys after a fixture's deploy waits for this first."""
        return LiveStack._runs_exactly("EngineReplica", engines)

    @staticmethod
    def _routers_settled(app: LiveApp) -> bool:
        return LiveStack._runs_exactly("WiMRouter", app.routers, app_running=True)

    @staticmethod
    def _runs_exactly(deployment: str, replicas: int, *, app_running: bool = False) -> bool:
        """Whether the `wim` application runs exactly `replicas` of `deployment`, starting or
        stopping none; with `app_running`, also whether Serve calls the application RUNNING."""
        from ray import serve

        status = serve.status().applications.get("wim")
        if status is None or deployment not in status.deployments:
            return False
        if app_running and status.status != "RUNNING":
            return False
        return status.deployments[deployment].replica_states == {"RUNNING": replicas}

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
