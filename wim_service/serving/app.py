"""`build_app`: assemble the WiM service from a validated config.

Used by `serve run deploy/serve_config.yaml` / `serve deploy` (as `import_path`
`wim_service.serving.app:build_app`, with the config's `args`) and by tests and `wim serve`.
Deployment-level settings (replicas, autoscaling, CPUs) come from the serve config's
`deployments:` section; the defaults here suit one small machine.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from wim_service.serving.config import ServiceConfig
from wim_service.serving.ingress import WiMIngress
from wim_service.serving.replica.client import ENGINE_DEPLOYMENT
from wim_service.serving.replica.deployment import EngineReplica

# The ingress: a `WiMRouter`, and the HTTP app `WiMIngress.__serve_build_asgi_app__` builds
# over it in the replica. (The deployment keeps the router's name: configs and dashboards use it.)
WiMRouterDeployment: Deployment = serve.deployment(
    name="WiMRouter",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,
    # Past this many waiting requests Serve's proxy answers 503 at once instead of queueing
    # without bound (serve config: `deployments[].max_queued_requests`).
    max_queued_requests=2000,
    # A router stopped by a rollout or a scale-down lets its open streams finish: with Serve's
    # default (20 s) a WiM stream, minutes long on a CPU, was cut with no `error` event.
    graceful_shutdown_timeout_s=300,
)(serve.ingress()(WiMIngress))

EngineReplicaDeployment: Deployment = serve.deployment(
    name=ENGINE_DEPLOYMENT,
    ray_actor_options={"num_cpus": 1},
    # Admission control lives in the engine (KV reservations); this only bounds concurrency.
    max_ongoing_requests=64,
    # A full queue answers the router at once (429 overloaded to the client), never hangs.
    max_queued_requests=256,
    # A leaving replica lets its running jobs finish before it stops (scale-down drain).
    graceful_shutdown_timeout_s=300,
    health_check_period_s=10,
    request_router_config=RequestRouterConfig(
        # Serve takes an import path here and resolves it in each caller's process.
        request_router_class="wim_service.serving.replica.pinning:PinnedReplicaRouter"  # type: ignore[arg-type]
    ),
)(EngineReplica)


def build_app(args: dict[str, Any]) -> Application:
    """The WiM application from a serve config's `args` (Serve calls this with one dict)."""
    return assemble(ServiceConfig.model_validate(args or {}))


def assemble(config: ServiceConfig, *, engine_options: dict[str, Any] | None = None) -> Application:
    """A `WiMRouter` ingress over `EngineReplica` deployments.

    `engine_options` overrides EngineReplica deployment settings (e.g. `num_replicas`) for
    Python callers; serve configs use their `deployments:` section instead.
    """
    deployment = EngineReplicaDeployment.options(**(engine_options or {}))
    engine = deployment.bind(config.engine.model_dump(), config.router.cost_profile)
    return WiMRouterDeployment.bind(engine, config.model_dump())
