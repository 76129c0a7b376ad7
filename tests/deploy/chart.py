"""What the chart tests share: the values they render the chart with (Helm's own library, no
helm binary, no cluster), the renderers, and readers of the rendered manifests and of the
Serve configs in deploy/."""

from __future__ import annotations

import copy
import ipaddress
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import (
    MAX_AGE_ENV,
    MAX_GIB_ENV,
    STORE_ENV,
)
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.serving.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "helm" / "wim-service"


SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"


TWO_ROUTERS_CONFIG = ROOT / "deploy" / "serve_config_two_routers.yaml"


MULTINODE_CONFIG = ROOT / "deploy" / "serve_config_multinode.yaml"


# The Ray custom resources that place the replicas on hosts (the chart's worker groups offer
# them, `ray start --resources` on bare hosts): what each replica asks for.
PLACEMENT = {"EngineReplica": {"wim_engine_host": 1}, "WiMRouter": {"wim_router_host": 1}}


KUBE_VERSION = "1.30.0"


RELEASE = "wim"


NAMESPACE = "wim-test"


KEYS_SECRET = "wim-api-keys"


KEYS_FILE = "/etc/wim/keys/keys.json"


# Every value set below uses API keys unless it says otherwise.
WITH_KEYS = {"auth": {"existingSecret": KEYS_SECRET}}


OPEN = {"auth": {"allowOpen": True}}


MONITORING_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    },
    "networkPolicy": {"prometheus": {"enabled": True}},
}


REDIS_URL_SECRET = {"name": "wim-redis", "key": "url"}


ENCRYPTION_SECRET = {"name": "wim-store-key", "key": "key"}


REDIS_PEERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "redis"}}}]


TWO_ROUTERS = {
    "router": {"replicas": 2},
    "store": {
        "backend": "redis",
        "redis": {"urlSecret": REDIS_URL_SECRET},
        "encryptionKeySecret": ENCRYPTION_SECRET,
    },
    "gcsFaultTolerance": {
        "enabled": True,
        "redisAddress": "redis-master.redis.svc:6379",
        "passwordSecret": {"name": "wim-redis", "key": "password"},
    },
    "networkPolicy": {
        "redis": {"to": REDIS_PEERS},
        "serveFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}}}
        ],
    },
}


KV_KEY_SECRET = {"name": "wim-kv-key", "key": "key"}


KV_MOUNT = "/var/lib/wim/kv"


KV_CLAIM = "wim-kv"


# Documents' KV on a shared volume (the multinode values keep it in Redis).
KV_VOLUME = {
    "kvStore": {
        "enabled": True,
        "volume": {"claimName": KV_CLAIM},
        "masterKeySecret": KV_KEY_SECRET,
    }
}


KV_ENV = {STORE_ENV, MASTER_KEY_ENV, MAX_GIB_ENV, MAX_AGE_ENV}


OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_worker_niceness": "0",
    # A call to a node cut off the network fails within seconds (docs/deploy.md, "Deadlines").
    "RAY_grpc_client_keepalive_time_ms": "5000",
    "RAY_grpc_client_keepalive_timeout_ms": "5000",
}


DEPLOYMENTS = {"WiMRouter", "EngineReplica"}


SERVE_PORT = 8000


# Ray's control-plane ports: GCS, dashboard, client, dashboard agent, metrics, a worker port
# (10002-19999) and a random raylet/object-manager port.
RAY_PORTS = [6379, 8265, 10001, 52365, 8080, 10002, 40123]


# Fields of KubeRay v1.6.0's ray.io/v1 types (ray-operator/apis/ray/v1/raycluster_types.go),
# the oldest KubeRay the chart supports (authOptions.secretName).
KUBERAY_FIELDS = {
    "RayClusterSpec": {
        "rayVersion",
        "enableInTreeAutoscaling",
        "autoscalerOptions",
        "headGroupSpec",
        "workerGroupSpecs",
        "headServiceAnnotations",
        "gcsFaultToleranceOptions",
        "authOptions",
        "suspend",
        "managedBy",
    },
    "AuthOptions": {"mode", "secretName", "enableK8sTokenAuth"},
    "GcsFaultToleranceOptions": {
        "redisAddress",
        "redisPassword",
        "redisUsername",
        "externalStorageNamespace",
    },
    "AutoscalerOptions": {
        "version",
        "resources",
        "image",
        "imagePullPolicy",
        "securityContext",
        "idleTimeoutSeconds",
        "upscalingMode",
        "env",
        "envFrom",
        "volumeMounts",
    },
    "HeadGroupSpec": {
        "rayStartParams",
        "template",
        "serviceType",
        "headService",
        "enableIngress",
        "resources",
        "labels",
    },
    "WorkerGroupSpec": {
        "groupName",
        "replicas",
        "minReplicas",
        "maxReplicas",
        "idleTimeoutSeconds",
        "rayStartParams",
        "template",
        "scaleStrategy",
        "numOfHosts",
        "suspend",
        "resources",
        "labels",
    },
}


# rayStartParams KubeRay refuses beside a group's `resources` (validateRayGroupResources).
RAY_RESOURCE_PARAMS = {"num-cpus", "num-gpus", "memory", "resources"}


def values_file(name: str) -> dict[str, Any]:
    """One of the chart's values files (values-gpu.yaml, values-multinode.yaml)."""
    return yaml.safe_load((CHART / name).read_text())


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    """Values merged as `helm -f a -f b` merges them (maps key by key, the rest replaced)."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def rendered_files(values: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest the chart renders with `values`, parsed."""
    return [
        doc
        for path, text in sorted(rendered_files(values).items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    files = rendered_files(values)
    return next(text for path, text in files.items() if path.endswith("NOTES.txt"))


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def rayservice(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = by_kind(manifests, "RayService")
    return service


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def pod_templates(service: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    cluster = service["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def ray_containers(manifests: list[dict[str, Any]]) -> Iterator[tuple[dict, dict]]:
    """(pod spec, container) of every Ray container."""
    for _, template in pod_templates(rayservice(manifests)):
        (container,) = template["spec"]["containers"]
        yield template["spec"], container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def the_app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def deployments(app: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in app["deployments"]}


VALUE_SETS = {
    "default": WITH_KEYS,
    "gpu": merged(values_file("values-gpu.yaml"), WITH_KEYS),
    "monitoring": merged(MONITORING_ON, WITH_KEYS),
    "two-routers": merged(TWO_ROUTERS, WITH_KEYS),
    # Several hosts (deploy/serve_config_multinode.yaml): two routers on Redis in a worker
    # group of their own, apart from the engines, and GCS fault tolerance.
    "multinode": merged(values_file("values-multinode.yaml"), WITH_KEYS),
    "open": merged(OPEN, {"autoscaler": {"enabled": False}}),
    # The KV store on a volume every Ray pod mounts, routers in a group of their own.
    "kv-volume": merged(KV_VOLUME, {"router": {"workerGroup": {"enabled": True}}}, WITH_KEYS),
}


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace, labels) or a host outside the cluster (labels None)."""

    namespace: str | None
    labels: dict[str, str] | None = None
    ip: str = "10.1.2.3"
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": str(self.namespace)} | self.namespace_labels


def expression_holds(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    if operator in ("Exists", "DoesNotExist"):
        return (key in labels) == (operator == "Exists")
    return (labels.get(key) in expression["values"]) == (operator == "In")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        expression_holds(e, labels) for e in selector.get("matchExpressions", [])
    )


def peer_matches(peer: dict[str, Any], other: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except", [])
        )
    if other.labels is None:  # not a pod: only ipBlocks select it
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != NAMESPACE:
        return False
    return selects(peer.get("podSelector", {}), other.labels)


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    return not ports or any(
        p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports
    )


def allowed(
    policies: list[dict[str, Any]],
    pod: Endpoint,
    other: Endpoint,
    port: int,
    direction: str,
    protocol: str = "TCP",
) -> bool:
    """Whether `policies` let `other` reach `pod` on `port` (direction "ingress"), or `pod`
    reach `other` (direction "egress"). The release's pods must be isolated by them."""
    policy_type, peers_key = {"ingress": ("Ingress", "from"), "egress": ("Egress", "to")}[direction]
    selecting = [
        p["spec"]
        for p in policies
        if policy_type in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod.labels)
    ]
    assert selecting, f"{pod} is not isolated for {direction}"
    return any(
        (not rule.get(peers_key) or any(peer_matches(peer, other) for peer in rule[peers_key]))
        and port_matches(rule.get("ports"), port, protocol)
        for spec in selecting
        for rule in spec.get(direction, [])
    )


def release_pods(manifests: list[dict[str, Any]]) -> dict[str, Endpoint]:
    templates = dict(pod_templates(rayservice(manifests)))
    pods = {
        "head": Endpoint(NAMESPACE, templates.pop("head")["metadata"]["labels"]),
        "worker": Endpoint(NAMESPACE, next(iter(templates.values()))["metadata"]["labels"]),
    }
    (test_pod,) = by_kind(manifests, "Pod")
    return pods | {"helm-test": Endpoint(NAMESPACE, test_pod["metadata"]["labels"])}


NEIGHBOUR = Endpoint(NAMESPACE, {"app": "other"})


ELSEWHERE = Endpoint("elsewhere", {"app": "client"})


CLIENT = Endpoint("clients", {"app": "client"})


OPERATOR = Endpoint("ray-system", {"app.kubernetes.io/name": "kuberay-operator"})


PROMETHEUS = Endpoint("monitoring", {"app.kubernetes.io/name": "prometheus"})


KUBE_DNS = Endpoint("kube-system", {"k8s-app": "kube-dns"})


REDIS = Endpoint("redis", {"app.kubernetes.io/name": "redis"})


INTERNET = Endpoint(None, ip="203.0.113.7")


def check_serve_config(config: dict[str, Any], routers: int = 1) -> None:
    """Ray Serve's schema accepts `config`, and no deployment option is unknown to Serve (its
    schema ignores unknown keys)."""
    ServeDeploySchema.model_validate(config)
    app = the_app(config)
    assert app["name"] == "wim" and app["route_prefix"] == "/"
    assert app["import_path"] == "wim_service.serving.app:build_app"
    options = deployments(app)
    assert set(options) == DEPLOYMENTS
    for option in options.values():
        assert set(option) <= set(DeploymentSchema.model_fields)
        assert set(option.get("autoscaling_config", {})) <= set(AutoscalingConfig.model_fields)
    assert options["WiMRouter"]["num_replicas"] == routers
    assert options["WiMRouter"]["ray_actor_options"]["num_cpus"] == 0
    scaling = options["EngineReplica"]["autoscaling_config"]
    assert {"min_replicas", "max_replicas", "target_ongoing_requests"} <= set(scaling)
    # A replica leaving on scale-down, and a router replaced by a rollout, let a whole
    # running job finish (minutes on CPU); Serve's default would cut it after 20 s.
    for name in DEPLOYMENTS:
        assert options[name]["graceful_shutdown_timeout_s"] >= 120, name
    EngineConfig.model_validate(app["args"]["engine"])
    RouterConfig.model_validate(app["args"]["router"])
    # Several routers share document sessions only through Redis; the URL is never in a config.
    store = app["args"]["router"].get("store", {"backend": "memory"})
    assert store == ({"backend": "redis"} if routers > 1 else {"backend": "memory"})
    assert "redis://" not in json.dumps(config)


def local_config(path: Path = SERVE_CONFIG) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def placement(config: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The custom resources each deployment's replicas ask for."""
    return {
        name: options["ray_actor_options"]["resources"]
        for name, options in deployments(the_app(config)).items()
        if "resources" in options.get("ray_actor_options", {})
    }
