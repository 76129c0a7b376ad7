"""The Helm chart (helm/wim-service) and the local Serve configs (deploy/serve_config*.yaml).

The chart is rendered offline by Helm's own library (PyPI helm-python-sdk, no helm binary, no
cluster). Built-in kinds are validated with kubernetes-validate; the RayService against
KubeRay's ray.io/v1 fields, with its pod templates validated as core/v1 PodTemplates. The
NetworkPolicies are evaluated with Kubernetes' rules against the pods that would talk to the
release. The Serve configs are parsed by Ray Serve's own schema and must describe the same
application.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr as autoscaler_view,
)
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer import documents
from wim_service.engine.kv_transfer.documents import (
    MAX_AGE_ENV,
    MAX_GIB_ENV,
    STORE_ENV,
    DocumentKV,
)
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.engine.kv_transfer.redis_store import RedisKVStore
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


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def value_set(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def manifests(value_set: str) -> list[dict[str, Any]]:
    return render(VALUE_SETS[value_set])


# --- the chart as a whole ---------------------------------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_chart_lints_clean(value_set: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[value_set], strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # Severity 1 is information ("icon is recommended"); warnings and errors are 2 and 3.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_builtin_kinds_validate_against_kubernetes_schemas(
    manifests: list[dict[str, Any]],
) -> None:
    builtin = [m for m in manifests if m["apiVersion"] in ("v1", "networking.k8s.io/v1")]
    assert {m["kind"] for m in builtin} >= {"Service", "Pod", "Secret", "NetworkPolicy"}
    for manifest in builtin:
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_ray_pod_templates_validate_as_core_pod_templates(
    manifests: list[dict[str, Any]],
) -> None:
    for group, template in pod_templates(rayservice(manifests)):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": group},
            "template": template,
        }
        kubernetes_validate.validate(wrapped, KUBE_VERSION, strict=True)


def test_rayservice_has_kuberays_required_fields(manifests: list[dict[str, Any]]) -> None:
    service = rayservice(manifests)
    assert service["apiVersion"] == "ray.io/v1"
    spec = service["spec"]
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "upgradeStrategy"}
    assert isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]
    workers = cluster["workerGroupSpecs"]
    # The API server prunes fields a CRD does not know without a word: no typos.
    assert set(cluster) <= KUBERAY_FIELDS["RayClusterSpec"]
    assert set(cluster["authOptions"]) <= KUBERAY_FIELDS["AuthOptions"]
    assert (
        set(cluster.get("gcsFaultToleranceOptions", {}))
        <= KUBERAY_FIELDS["GcsFaultToleranceOptions"]
    )
    assert set(cluster.get("autoscalerOptions", {})) <= KUBERAY_FIELDS["AutoscalerOptions"]
    assert set(head) <= KUBERAY_FIELDS["HeadGroupSpec"]
    # ...and the ones its CRD requires (rayStartParams too, before KubeRay 1.1).
    assert {"template", "rayStartParams"} <= set(head)
    assert len({w["groupName"] for w in workers}) == len(workers)
    for worker in workers:
        assert set(worker) <= KUBERAY_FIELDS["WorkerGroupSpec"]
        assert {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"} <= set(
            worker
        )
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
        # Ray resources either in `resources` or in rayStartParams, never both (KubeRay refuses).
        assert worker["resources"]
        assert RAY_RESOURCE_PARAMS.isdisjoint(worker["rayStartParams"])
    for group in (head, *workers):
        # KubeRay's CRD: rayStartParams and resources are map[string]string; one container
        # per Ray pod.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert all(isinstance(v, str) for v in group.get("resources", {}).values())
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"].startswith("wim-service:")
    assert head["rayStartParams"]["num-cpus"] == "0"
    head_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    # KubeRay builds <name>-serve-svc from the head container's port named "serve", and
    # <name>-head-svc from all of them: the workers join through "gcs-server", the operator
    # deploys the Serve config through "dashboard". Nothing uses Ray Client (10001).
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "serve": 8000, "metrics": 8080}


def test_every_ray_container_runs_offline_at_normal_priority(
    manifests: list[dict[str, Any]],
) -> None:
    for _, container in ray_containers(manifests):
        env = {name: e.get("value") for name, e in env_of(container).items()}
        assert OFFLINE_ENV.items() <= env.items()
        assert container["resources"]["requests"] and container["resources"]["limits"]


def test_serve_config_v2_is_a_valid_serve_config(
    value_set: str, manifests: list[dict[str, Any]]
) -> None:
    config = serve_config(rayservice(manifests))
    check_serve_config(config, routers=2 if value_set in ("two-routers", "multinode") else 1)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 930}


def test_gpu_values_switch_image_and_ask_for_gpus() -> None:
    service = rayservice(render(VALUE_SETS["gpu"]))
    cluster = service["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["image"] == "wim-service:0.1.0-gpu"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in worker["template"]["spec"]["tolerations"])
    (head_container,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    engine = deployments(the_app(serve_config(service)))["EngineReplica"]
    assert engine["ray_actor_options"]["num_gpus"] == 1


def test_monitoring_objects_render_only_when_enabled() -> None:
    kinds = {m["kind"] for m in render(WITH_KEYS)}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}
    manifests = render(VALUE_SETS["monitoring"])
    (monitor,) = by_kind(manifests, "ServiceMonitor")
    (metrics_service,) = [
        s for s in by_kind(manifests, "Service") if s["metadata"]["name"].endswith("-metrics")
    ]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= metrics_service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == metrics_service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "wim-service", "action": "replace"} in endpoint[
        "relabelings"
    ]
    # The metrics Service selects the head pod only (one scrape target per cluster).
    head = rayservice(manifests)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert metrics_service["spec"]["selector"].items() <= head["metadata"]["labels"].items()


def test_prometheus_rule_and_dashboard_ship_the_files_in_deploy() -> None:
    manifests = render(VALUE_SETS["monitoring"])
    (rule,) = by_kind(manifests, "PrometheusRule")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "wim-alerts.yaml").read_text())
    assert rule["spec"] == alerts
    (dashboard,) = by_kind(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    shipped = json.loads((ROOT / "deploy" / "grafana" / "wim-service-dashboard.json").read_text())
    assert json.loads(text) == shipped


def test_service_monitor_sends_the_key_a_keyed_metrics_route_needs() -> None:
    """With `router.metrics_require_key`, Prometheus must send a tenant's API key."""
    key = {"type": "Bearer", "credentials": {"name": "wim-metrics-key", "key": "token"}}
    values = {"metrics": {"serviceMonitor": {"authorization": key}}}
    (monitor,) = by_kind(render(merged(VALUE_SETS["monitoring"], values)), "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == key
    (plain,) = by_kind(render(VALUE_SETS["monitoring"]), "ServiceMonitor")
    assert "authorization" not in plain["spec"]["endpoints"][0]


def test_service_monitor_without_metrics_service_is_refused() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.service\.enabled"):
        render(merged(values, WITH_KEYS))


@pytest.mark.parametrize(
    "values",
    [
        {"serve": {"application": {"args": {"engine": {"kv_cache_gibs": 1}}}}},
        {"serve": {"application": {"args": {"engine": {"block_size": 40}}}}},
        {"worker": {"rayStartParams": {"object-store-memory": 536870912}}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"serve": {"application": {"deployments": {"EngineReplica": {"name": "Other"}}}}},
        {"unknownTopLevel": True},
        {"serve": {"application": {"args": {"router": {"store": {"backend": "redis"}}}}}},
        {"serve": {"application": {"deployments": {"WiMRouter": {"num_replicas": 2}}}}},
        {"router": {"replicas": 0}},
        {"store": {"backend": "etcd"}},
        {"store": {"redis": {"url": "redis://secret@redis:6379"}}},
        {"auth": {"keys": ["sk-plain-text"]}},
        {"kvStore": {"enabled": True, "url": "redis://secret@redis:6379"}},
        {"kvStore": {"enabled": True, "masterKey": "c2VjcmV0"}},
        {"kvStore": {"enabled": True, "maxGiB": 0}},
        {"kvStore": {"enabled": True, "volume": {"mountPath": "kv"}}},
        {"networkPolicy": {"serveFrom": [{"podSelektor": {}}]}},
        {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis://host"}},
        {"worker": {"rayStartParams": {"num-cpus": "4"}}},
        {"worker": {"enginesPerPod": 0}},
        {"router": {"workerGroup": {"rayStartParams": {"resources": '"{\\"CPU\\": 1}"'}}}},
        {"router": {"workerGroup": {"routersPerPod": 0}}},
        {
            "serve": {
                "application": {
                    "deployments": {
                        "EngineReplica": {"ray_actor_options": {"resources": {"gpu_host": 1}}}
                    }
                }
            }
        },
    ],
    ids=[
        "engine-typo",
        "block-size",
        "non-string-ray-param",
        "pull-policy",
        "renamed",
        "top",
        "store-in-args",
        "router-replicas-in-deployments",
        "no-router",
        "store-backend",
        "redis-url-in-values",
        "keys-in-values",
        "kv-url-in-values",
        "kv-key-in-values",
        "kv-unbounded",
        "kv-relative-mount",
        "peer-typo",
        "gcs-address-without-port",
        "ray-resources-beside-the-groups",
        "no-engine-per-pod",
        "router-ray-resources",
        "no-router-per-pod",
        "placement-in-values",
    ],
)
def test_values_schema_refuses_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_values_schema_names_every_engine_config_field() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["definitions"]["engine"]["properties"]) == set(EngineConfig.model_fields)


def test_notes_curl_the_serve_service_with_a_key() -> None:
    text = notes(WITH_KEYS)
    # `helm install wim` names the RayService "wim"; KubeRay names its Service wim-serve-svc.
    assert f"svc/{RELEASE}-serve-svc 8000:8000" in text
    assert "curl -fsS http://127.0.0.1:8000/readyz" in text
    assert '-H "Authorization: Bearer $WIM_API_KEY"' in text
    body = text.split("-d '", 1)[1].split("'", 1)[0]
    assert set(json.loads(body)) == {"context", "query"}
    assert "WARNING" not in text


# --- access control: API keys, Ray's token, pod hardening --------------------------------------


def test_api_keys_secret_is_mounted_read_only_with_its_path_in_the_env() -> None:
    manifests = render(WITH_KEYS)
    for spec, container in ray_containers(manifests):
        env = env_of(container)
        assert env["WIM_API_KEYS_FILE"] == {"name": "WIM_API_KEYS_FILE", "value": KEYS_FILE}
        assert "WIM_ALLOW_OPEN" not in env
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/wim/keys"]
        assert mount["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mount["name"]]["secret"] == {
            "secretName": KEYS_SECRET,
            "items": [{"key": "keys.json", "path": "keys.json"}],
            "defaultMode": 0o440,
        }
    # The chart renders no key material: the only Secret it makes is Ray's token.
    secrets = by_kind(manifests, "Secret")
    assert [s["metadata"]["name"] for s in secrets] == [f"{RELEASE}-ray-token"]


def test_render_fails_without_api_keys_unless_open_is_explicit() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"auth\.existingSecret is empty.*allowOpen"):
        render()
    with pytest.raises(helm.HelmRenderError, match=r"both set"):
        render(merged(WITH_KEYS, OPEN))
    manifests = render(OPEN)
    for spec, container in ray_containers(manifests):
        env = env_of(container)
        assert env["WIM_ALLOW_OPEN"] == {"name": "WIM_ALLOW_OPEN", "value": "1"}
        assert "WIM_API_KEYS_FILE" not in env
        assert not any("secret" in v for v in spec["volumes"])
    text = notes(OPEN)
    # First thing in the notes.
    assert "WARNING: THIS SERVICE HAS NO API KEYS" in text.lstrip().splitlines()[1]
    assert "Authorization" not in text


def test_ray_token_auth_is_on_with_the_token_from_a_secret() -> None:
    manifests = render(WITH_KEYS)
    cluster = rayservice(manifests)["spec"]["rayClusterConfig"]
    secret_name = f"{RELEASE}-ray-token"
    assert cluster["authOptions"] == {"mode": "token", "secretName": secret_name}
    (secret,) = by_kind(manifests, "Secret")
    assert secret["metadata"]["name"] == secret_name
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", token)
    # Random per install (an upgrade reads the installed one back with `lookup`).
    (again,) = by_kind(render(WITH_KEYS), "Secret")
    assert again["data"] != secret["data"]
    # No container turns Ray's authentication off behind KubeRay's back.
    for _, container in ray_containers(manifests):
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}.isdisjoint(env_of(container))
    # An existing Secret instead: the chart makes none.
    manifests = render(merged(WITH_KEYS, {"rayAuth": {"existingSecret": "my-ray-token"}}))
    assert rayservice(manifests)["spec"]["rayClusterConfig"]["authOptions"] == {
        "mode": "token",
        "secretName": "my-ray-token",
    }
    assert by_kind(manifests, "Secret") == []


def dockerfile_user() -> tuple[int, int]:
    (uid, gid) = re.findall(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)[-1]
    return int(uid), int(gid)


HARDENED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
    "readOnlyRootFilesystem": True,
}


def test_every_container_is_non_root_read_only_and_without_capabilities(
    manifests: list[dict[str, Any]],
) -> None:
    uid, gid = dockerfile_user()
    user = {"runAsUser": uid, "runAsGroup": gid}
    cluster = rayservice(manifests)["spec"]["rayClusterConfig"]
    containers = [container for _, container in ray_containers(manifests)]
    if "autoscalerOptions" in cluster:
        containers.append(cluster["autoscalerOptions"])
    for pod in by_kind(manifests, "Pod"):  # helm test
        containers.extend(pod["spec"]["containers"])
    assert len(containers) >= 3
    for container in containers:
        assert (HARDENED | user).items() <= container["securityContext"].items()
    for spec, _ in ray_containers(manifests):
        assert (user | {"runAsNonRoot": True}).items() <= spec["securityContext"].items()
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_ray_containers_write_only_to_their_empty_dirs(
    value_set: str, manifests: list[dict[str, Any]]
) -> None:
    cluster = rayservice(manifests)["spec"]["rayClusterConfig"]
    for spec, container in ray_containers(manifests):
        volumes = {v["name"]: v for v in spec["volumes"]}
        writable = {
            m["mountPath"]: volumes[m["name"]]
            for m in container["volumeMounts"]
            if not m.get("readOnly")
        }
        # ...and to the KV store's volume when it is one.
        kv_volume = writable.pop(KV_MOUNT, None)
        if value_set == "kv-volume":
            assert kv_volume == {
                "name": "kv-store",
                "persistentVolumeClaim": {"claimName": KV_CLAIM},
            }
        else:
            assert kv_volume is None
        # Ray's session dir and torch's cache, vLLM's shared memory, the caches under $HOME.
        assert set(writable) == {"/tmp", "/dev/shm", "/home/ray"}
        assert all(set(v) == {"name", "emptyDir"} for v in writable.values())
        assert writable["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert all(v["emptyDir"]["sizeLimit"] for v in writable.values())
    if "autoscalerOptions" in cluster:
        head = cluster["headGroupSpec"]["template"]["spec"]
        mounts = cluster["autoscalerOptions"]["volumeMounts"]
        assert {m["mountPath"] for m in mounts} == {"/tmp", "/home/ray"}
        assert {m["name"] for m in mounts} <= {v["name"] for v in head["volumes"]}


def test_only_the_autoscaler_gets_a_service_account_token() -> None:
    for value_set, autoscaler in (("default", True), ("open", False)):
        manifests = render(VALUE_SETS[value_set])
        templates = dict(pod_templates(rayservice(manifests)))
        assert templates.pop("head")["spec"]["automountServiceAccountToken"] is autoscaler
        assert all(t["spec"]["automountServiceAccountToken"] is False for t in templates.values())


# --- network: Services and NetworkPolicies ------------------------------------------------------


def test_no_chart_service_exposes_rays_control_plane(manifests: list[dict[str, Any]]) -> None:
    head = rayservice(manifests)["spec"]["rayClusterConfig"]["headGroupSpec"]
    named = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    for service in by_kind(manifests, "Service"):
        for port in service["spec"]["ports"]:
            target = named.get(port["targetPort"], port["targetPort"])
            assert {port["port"], target}.isdisjoint({6379, 8265, 10001})
    # KubeRay's head Service (dashboard, GCS) stays inside the cluster, without an Ingress.
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)


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


def test_ray_ports_only_between_the_releases_ray_pods() -> None:
    manifests = render(WITH_KEYS)
    policies = by_kind(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    ray_pods = (pods["head"], pods["worker"])
    for pod in ray_pods:
        for peer in ray_pods:
            assert all(allowed(policies, pod, peer, p, "ingress") for p in RAY_PORTS)
            assert all(allowed(policies, pod, peer, p, "egress") for p in RAY_PORTS)
        for outsider in (NEIGHBOUR, ELSEWHERE, PROMETHEUS, INTERNET, pods["helm-test"]):
            assert not any(allowed(policies, pod, outsider, p, "ingress") for p in RAY_PORTS)
            # ...and the Serve HTTP port from anyone (networkPolicy.serveFrom empty).
            assert allowed(policies, pod, outsider, SERVE_PORT, "ingress")
    # The operator deploys the Serve config through the head's dashboard, nothing more.
    assert allowed(policies, pods["head"], OPERATOR, 8265, "ingress")
    assert not allowed(policies, pods["worker"], OPERATOR, 8265, "ingress")
    assert not any(
        allowed(policies, pods["head"], OPERATOR, p, "ingress") for p in RAY_PORTS if p != 8265
    )
    # The pods meant for clients are the ones KubeRay's serve Service selects: all Ray pods.
    assert all(allowed(policies, pod, OPERATOR, SERVE_PORT, "ingress") for pod in ray_pods)


def test_ray_pods_reach_only_dns_each_other_and_the_kubernetes_api() -> None:
    manifests = render(WITH_KEYS)
    policies = by_kind(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    head, worker = pods["head"], pods["worker"]
    for pod in (head, worker):
        assert allowed(policies, pod, KUBE_DNS, 53, "egress", "UDP")
        assert allowed(policies, pod, KUBE_DNS, 53, "egress", "TCP")
        assert not allowed(policies, pod, KUBE_DNS, 80, "egress")
        assert not allowed(policies, pod, REDIS, 6379, "egress")  # memory store
        assert not allowed(policies, pod, INTERNET, 80, "egress")
        assert not allowed(policies, pod, NEIGHBOUR, SERVE_PORT, "egress")
    # The autoscaler sidecar (head only) calls the Kubernetes API.
    assert allowed(policies, head, INTERNET, 443, "egress")
    assert not allowed(policies, worker, INTERNET, 443, "egress")
    no_autoscaler = render(VALUE_SETS["open"])
    policies = by_kind(no_autoscaler, "NetworkPolicy")
    assert not allowed(policies, release_pods(no_autoscaler)["head"], INTERNET, 443, "egress")


def test_restricted_serve_port_admits_the_listed_clients_the_operator_and_helm_test() -> None:
    manifests = render(VALUE_SETS["two-routers"])
    policies = by_kind(manifests, "NetworkPolicy")
    pods = release_pods(manifests)
    for pod in (pods["head"], pods["worker"]):
        for admitted in (CLIENT, OPERATOR, pods["helm-test"]):
            assert allowed(policies, pod, admitted, SERVE_PORT, "ingress")
            assert not any(allowed(policies, pod, admitted, p, "ingress") for p in [6379, 10001])
        for refused in (NEIGHBOUR, ELSEWHERE, INTERNET, PROMETHEUS):
            assert not allowed(policies, pod, refused, SERVE_PORT, "ingress")
        # Redis, limited to networkPolicy.redis.to.
        assert allowed(policies, pod, REDIS, 6379, "egress")
        assert not allowed(policies, pod, INTERNET, 6379, "egress")


def test_prometheus_reaches_the_metrics_ports_only_when_enabled() -> None:
    for value_set, enabled in (("monitoring", True), ("default", False)):
        manifests = render(VALUE_SETS[value_set])
        policies = by_kind(manifests, "NetworkPolicy")
        pods = release_pods(manifests)
        for pod in (pods["head"], pods["worker"]):
            assert allowed(policies, pod, PROMETHEUS, 8080, "ingress") is enabled
            assert not allowed(policies, pod, PROMETHEUS, 8265, "ingress")
            assert not allowed(policies, pod, ELSEWHERE, 8080, "ingress")


def test_network_policies_can_be_left_to_the_cluster() -> None:
    manifests = render(merged(WITH_KEYS, {"networkPolicy": {"enabled": False}}))
    assert by_kind(manifests, "NetworkPolicy") == []


# --- the session store and GCS fault tolerance --------------------------------------------------


def test_several_routers_need_the_redis_store() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"router\.replicas=2 needs store\.backend=redis"
    ):
        render(merged(WITH_KEYS, {"router": {"replicas": 2}}))
    with pytest.raises(helm.HelmRenderError, match=r"store\.redis\.urlSecret\.name"):
        render(merged(WITH_KEYS, {"store": {"backend": "redis"}}))
    with pytest.raises(helm.HelmRenderError, match=r"encryptionKeySecret.*store\.backend=redis"):
        render(merged(WITH_KEYS, {"store": {"encryptionKeySecret": ENCRYPTION_SECRET}}))
    app = the_app(serve_config(rayservice(render(VALUE_SETS["two-routers"]))))
    assert deployments(app)["WiMRouter"]["num_replicas"] == 2
    assert app["args"]["router"]["store"] == {"backend": "redis"}
    # StoreConfig's other options pass through; the backend is always store.backend.
    options = {"serve": {"application": {"args": {"router": {"store": {"key_prefix": "a:"}}}}}}
    app = the_app(serve_config(rayservice(render(merged(VALUE_SETS["two-routers"], options)))))
    assert app["args"]["router"]["store"] == {"backend": "redis", "key_prefix": "a:"}
    RouterConfig.model_validate(app["args"]["router"])


def test_redis_url_and_encryption_key_come_from_secrets() -> None:
    manifests = render(VALUE_SETS["two-routers"])
    for _, container in ray_containers(manifests):
        env = env_of(container)
        assert env["WIM_REDIS_URL"]["valueFrom"] == {"secretKeyRef": REDIS_URL_SECRET}
        assert env["WIM_STORE_ENCRYPTION_KEY"]["valueFrom"] == {"secretKeyRef": ENCRYPTION_SECRET}
    for _, container in ray_containers(render(WITH_KEYS)):
        assert {"WIM_REDIS_URL", "WIM_STORE_ENCRYPTION_KEY"}.isdisjoint(env_of(container))


def test_gcs_fault_tolerance_uses_redis_with_the_password_from_a_secret() -> None:
    cluster = rayservice(render(VALUE_SETS["two-routers"]))["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "wim-redis", "key": "password"}}},
    }
    assert (
        "gcsFaultToleranceOptions" not in rayservice(render(WITH_KEYS))["spec"]["rayClusterConfig"]
    )
    with pytest.raises(helm.HelmRenderError, match=r"gcsFaultTolerance\.redisAddress"):
        render(merged(WITH_KEYS, {"gcsFaultTolerance": {"enabled": True}}))
    # The multinode values turn it on; a storage namespace of one's own is passed on.
    namespaced = {"gcsFaultTolerance": {"externalStorageNamespace": "wim-prod"}}
    cluster = rayservice(render(merged(VALUE_SETS["multinode"], namespaced)))["spec"][
        "rayClusterConfig"
    ]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "wim-redis", "key": "password"}}},
        "externalStorageNamespace": "wim-prod",
    }
    # With the memory store, GCS fault tolerance alone opens the way to Redis.
    manifests = render(merged(WITH_KEYS, {"gcsFaultTolerance": TWO_ROUTERS["gcsFaultTolerance"]}))
    policies = by_kind(manifests, "NetworkPolicy")
    assert allowed(policies, release_pods(manifests)["head"], REDIS, 6379, "egress")


# --- stored document KV -----------------------------------------------------------------------

KV_SECRETS = {
    ("wim-redis", "url"): "redis://:PASSWORD@redis-master.redis.svc:6379/0",
    ("wim-kv-key", "key"): base64.b64encode(bytes(range(32))).decode(),
}


def kv_store_opened(
    container: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, int] | None:
    """What `DocumentKV.from_env` (the routers' and the engines' code) opens in a process
    with the container's environment, its Secret keys read from KV_SECRETS: the store's URL
    and bound, or None for no store."""
    for name in KV_ENV:
        monkeypatch.delenv(name, raising=False)
    for variable in container["env"]:
        if variable["name"] in KV_ENV:
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            value = KV_SECRETS[ref["name"], ref["key"]] if ref else variable["value"]
            monkeypatch.setenv(variable["name"], value)
    opened: list[tuple[str, int]] = []
    # The directory backend would create its folder here: record what would be opened.
    monkeypatch.setattr(documents, "open_store", lambda url, size: opened.append((url, size)))
    store = DocumentKV.from_env()
    assert (store is None) == (opened == [])
    return opened[0] if opened else None


def test_kv_store_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for spec, container in ray_containers(render(WITH_KEYS)):
        assert KV_ENV.isdisjoint(env_of(container))
        assert not any("persistentVolumeClaim" in v for v in spec["volumes"])
        assert kv_store_opened(container, monkeypatch) is None


def test_kv_store_on_a_volume_every_ray_pod_mounts(monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = render(VALUE_SETS["kv-volume"])
    # The head (a router may run there), the engines and the routers' own group.
    assert {group for group, _ in pod_templates(rayservice(manifests))} == {
        "head",
        "engines",
        "routers",
    }
    for spec, container in ray_containers(manifests):
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == KV_MOUNT]
        assert not mount.get("readOnly")
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": KV_CLAIM}
        env = env_of(container)
        assert env[MASTER_KEY_ENV]["valueFrom"] == {"secretKeyRef": KV_KEY_SECRET}
        assert kv_store_opened(container, monkeypatch) == (KV_MOUNT, 8 * 2**30)
    # The bound reaches the processes as a number they read.
    half = merged(VALUE_SETS["kv-volume"], {"kvStore": {"maxGiB": 0.5, "maxAgeHours": 2}})
    for _, container in ray_containers(render(half)):
        assert kv_store_opened(container, monkeypatch) == (KV_MOUNT, 2**29)
        assert DocumentKV.from_env().max_age_s == 7200  # type: ignore[union-attr]
    # The directory store needs no Redis.
    policies = by_kind(manifests, "NetworkPolicy")
    assert not allowed(policies, release_pods(manifests)["head"], REDIS, 6379, "egress")


def test_kv_store_in_redis_with_the_url_from_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The multinode values keep documents' KV in the session store's Redis."""
    manifests = render(VALUE_SETS["multinode"])
    url = KV_SECRETS["wim-redis", "url"]
    for spec, container in ray_containers(manifests):
        env = env_of(container)
        assert env[STORE_ENV]["valueFrom"] == {"secretKeyRef": REDIS_URL_SECRET}
        assert env[STORE_ENV]["valueFrom"] == env["WIM_REDIS_URL"]["valueFrom"]
        assert env[MASTER_KEY_ENV]["valueFrom"] == {"secretKeyRef": KV_KEY_SECRET}
        assert not any("persistentVolumeClaim" in v for v in spec["volumes"])
        assert kv_store_opened(container, monkeypatch) == (url, 8 * 2**30)
    monkeypatch.undo()
    assert isinstance(documents.open_store(url, 2**30), RedisKVStore)
    # No secret lands in the manifests.
    assert "redis://" not in json.dumps(manifests)
    # With the memory session store and no GCS fault tolerance, the KV store alone opens the
    # way to Redis.
    kv_redis = {
        "kvStore": {
            "enabled": True,
            "redisUrlSecret": REDIS_URL_SECRET,
            "masterKeySecret": KV_KEY_SECRET,
        }
    }
    manifests = render(merged(WITH_KEYS, kv_redis))
    policies = by_kind(manifests, "NetworkPolicy")
    for pod in ("head", "worker"):
        assert allowed(policies, release_pods(manifests)[pod], REDIS, 6379, "egress")


@pytest.mark.parametrize(
    ("kv_store", "message"),
    [
        ({"volume": {"claimName": KV_CLAIM}}, r"needs kvStore\.masterKeySecret\.name"),
        ({"masterKeySecret": KV_KEY_SECRET}, r"needs a backend"),
        (
            {
                "volume": {"claimName": KV_CLAIM},
                "redisUrlSecret": REDIS_URL_SECRET,
                "masterKeySecret": KV_KEY_SECRET,
            },
            r"both set: choose one backend",
        ),
        (
            {
                "volume": {"claimName": KV_CLAIM, "mountPath": "/tmp/kv"},
                "masterKeySecret": KV_KEY_SECRET,
            },
            r"mountPath=/tmp/kv is inside /tmp",
        ),
    ],
    ids=["no-master-key", "no-backend", "two-backends", "mount-over-scratch"],
)
def test_kv_store_values_that_would_not_work_are_refused(
    kv_store: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(merged(WITH_KEYS, {"kvStore": {"enabled": True} | kv_store}))


@pytest.mark.parametrize(("option", "value"), [("kv_store", KV_MOUNT), ("kv_store_max_gib", 1)])
def test_kv_store_is_named_in_the_environment_only(option: str, value: object) -> None:
    """The routers read the store from the environment, not from the engine's config."""
    engine = {"serve": {"application": {"args": {"engine": {option: value}}}}}
    with pytest.raises(helm.HelmRenderError, match=rf"engine\.{option}: set kvStore"):
        render(merged(WITH_KEYS, engine))


# --- placement: worker groups and the resources replicas ask for --------------------------------


def replica_ask(options: dict[str, Any]) -> dict[str, float]:
    """What one replica of a deployment asks Ray for (Serve's own default: one CPU)."""
    actor = options.get("ray_actor_options", {})
    ask = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0)}
    return {k: v for k, v in (ask | actor.get("resources", {})).items() if v}


def holders(manifests: list[dict[str, Any]]) -> dict[str, set[str]]:
    """For each deployment, the node types (Ray's name for the head and the worker groups) that
    Ray's autoscaler sees able to hold one of its replicas."""
    service = rayservice(manifests)
    ray_cr = {"metadata": {"name": RELEASE, "namespace": NAMESPACE}}
    node_types = autoscaler_view(ray_cr | {"spec": service["spec"]["rayClusterConfig"]})[
        "available_node_types"
    ]
    return {
        name: {
            node_type
            for node_type, node in node_types.items()
            if all(node["resources"].get(r, 0) >= n for r, n in replica_ask(options).items())
        }
        for name, options in deployments(the_app(serve_config(service))).items()
    }


@pytest.mark.parametrize(
    ("value_set", "engines", "routers"),
    [
        ("default", {"engines"}, {"headgroup", "engines"}),
        ("gpu", {"gpu-engines"}, {"headgroup", "gpu-engines"}),
        ("multinode", {"engines"}, {"routers"}),
        # The custom resources keep them apart, not the pods' sizes.
        ("multinode-large-router-pods", {"engines"}, {"routers"}),
    ],
    ids=["default", "gpu", "multinode", "multinode-large-router-pods"],
)
def test_replicas_can_land_only_on_their_worker_groups(
    value_set: str, engines: set[str], routers: set[str]
) -> None:
    large_router_pods = {"limits": {"cpu": "8", "memory": "32Gi"}}
    values = {
        **VALUE_SETS,
        "multinode-large-router-pods": merged(
            VALUE_SETS["multinode"],
            {"router": {"workerGroup": {"resources": large_router_pods}}},
        ),
    }[value_set]
    assert holders(render(values)) == {
        "EngineReplica": engines,
        "WiMRouter": routers,
    }


def test_multinode_chart_places_replicas_as_the_multinode_config() -> None:
    service = rayservice(render(VALUE_SETS["multinode"]))
    config = serve_config(service)
    assert placement(config) == placement(local_config(MULTINODE_CONFIG)) == PLACEMENT
    # Each group's pods offer the resource its replicas ask for, one replica per pod.
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["engines"]["resources"] == {"wim_engine_host": "1"}
    assert groups["routers"]["resources"] == {"wim_router_host": "1"}
    assert (
        groups["routers"]["minReplicas"]
        == deployments(the_app(config))["WiMRouter"]["num_replicas"]
    )
    # Router pods also run a Serve proxy, behind KubeRay's serve Service like the others.
    (container,) = groups["routers"]["template"]["spec"]["containers"]
    assert {"name": "serve", "containerPort": SERVE_PORT} in container["ports"]
    # Several engines per pod: each pod offers as many.
    values = merged(VALUE_SETS["multinode"], {"worker": {"enginesPerPod": 2}})
    (engines, _) = rayservice(render(values))["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert engines["resources"] == {"wim_engine_host": "2"}


def may_share_a_node(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether Kubernetes may put a pod of worker group `a` and one of `b` on one node: not if
    either's required podAntiAffinity per hostname selects the other's labels (its template's,
    and the ray.io/group KubeRay adds to every pod)."""

    def labels(group: dict[str, Any]) -> dict[str, str]:
        return group["template"]["metadata"]["labels"] | {"ray.io/group": group["groupName"]}

    def repels(group: dict[str, Any], other: dict[str, Any]) -> bool:
        anti = group["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
        return any(
            term["topologyKey"] == "kubernetes.io/hostname"
            and selects(term["labelSelector"], labels(other))
            for term in anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        )

    return not (repels(a, b) or repels(b, a))


def test_multinode_values_keep_routers_and_engines_on_separate_nodes() -> None:
    cluster = rayservice(render(VALUE_SETS["multinode"]))["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    engines, routers = groups["engines"], groups["routers"]
    assert not may_share_a_node(engines, engines)
    assert not may_share_a_node(routers, routers)
    assert not may_share_a_node(routers, engines)
    # Without them (the default values) Kubernetes may stack engine pods on one node.
    (default_engines,) = rayservice(render(WITH_KEYS))["spec"]["rayClusterConfig"][
        "workerGroupSpecs"
    ]
    assert may_share_a_node(default_engines, default_engines)


def test_replicas_no_pod_could_hold_are_refused() -> None:
    too_many_engines = {
        "serve": {
            "application": {
                "deployments": {"EngineReplica": {"autoscaling_config": {"max_replicas": 5}}}
            }
        }
    }
    with pytest.raises(helm.HelmRenderError, match=r"max_replicas=5 exceeds .*=4"):
        render(merged(WITH_KEYS, too_many_engines))
    render(merged(WITH_KEYS, too_many_engines, {"worker": {"enginesPerPod": 2}}))
    with pytest.raises(helm.HelmRenderError, match=r"router\.replicas=3 exceeds .*=2"):
        render(merged(VALUE_SETS["multinode"], {"router": {"replicas": 3}}))
    # Without the routers group the routers go anywhere: nothing to refuse.
    render(merged(VALUE_SETS["two-routers"], {"router": {"replicas": 3}}))


def test_router_pods_are_ray_pods_to_the_network_policies() -> None:
    manifests = render(VALUE_SETS["multinode"])
    policies = by_kind(manifests, "NetworkPolicy")
    templates = dict(pod_templates(rayservice(manifests)))
    pods = [Endpoint(NAMESPACE, t["metadata"]["labels"]) for t in templates.values()]
    assert set(templates) == {"head", "engines", "routers"}
    for pod in pods:
        for peer in pods:
            assert all(allowed(policies, pod, peer, p, "ingress") for p in RAY_PORTS)
            assert all(allowed(policies, pod, peer, p, "egress") for p in RAY_PORTS)
        assert allowed(policies, pod, REDIS, 6379, "egress")


# --- the Serve application, in the chart and in deploy/serve_config*.yaml ---------------------


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


def test_local_serve_config_is_valid_and_stays_on_loopback() -> None:
    config = local_config()
    check_serve_config(config)
    assert config["http_options"]["host"] == "127.0.0.1"
    scaling = deployments(the_app(config))["EngineReplica"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)


def test_two_router_config_is_the_local_config_with_two_routers_on_redis() -> None:
    config = local_config(TWO_ROUTERS_CONFIG)
    check_serve_config(config, routers=2)
    # Everything else exactly as deploy/serve_config.yaml: one place to change a setting.
    app = the_app(config)
    del app["args"]["router"]["store"]
    deployments(app)["WiMRouter"]["num_replicas"] = 1
    assert config == local_config()
    assert {"WIM_REDIS_URL", STORE_ENV, MASTER_KEY_ENV} <= set(
        re.findall(r"WIM_[A-Z_]+", TWO_ROUTERS_CONFIG.read_text())
    )


def placement(config: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The custom resources each deployment's replicas ask for."""
    return {
        name: options["ray_actor_options"]["resources"]
        for name, options in deployments(the_app(config)).items()
        if "resources" in options.get("ray_actor_options", {})
    }


def test_multinode_config_is_the_two_router_config_placed_on_hosts() -> None:
    config = local_config(MULTINODE_CONFIG)
    check_serve_config(config, routers=2)
    assert placement(config) == PLACEMENT
    # Sessions and documents' KV in Redis, named in the hosts' environment (as the chart's
    # multinode values do).
    assert {"WIM_REDIS_URL", STORE_ENV, MASTER_KEY_ENV} <= set(
        re.findall(r"WIM_[A-Z_]+", MULTINODE_CONFIG.read_text())
    )
    # A proxy on every node, listening beyond loopback: any host takes requests.
    assert config["proxy_location"] == "EveryNode"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 930}
    # Both engines from the start, one per engine host.
    scaling = deployments(the_app(config))["EngineReplica"]["autoscaling_config"]
    assert scaling["min_replicas"] == scaling["max_replicas"] == 2
    # Everything else exactly as deploy/serve_config_two_routers.yaml.
    for options in deployments(the_app(config)).values():
        del options["ray_actor_options"]["resources"]
    scaling["min_replicas"] = 1
    two_routers = local_config(TWO_ROUTERS_CONFIG)
    assert config == two_routers | {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 930},
    }


def shape(app: dict[str, Any]) -> dict[str, Any]:
    """What must not drift between configs: the application, its deployments and the names of
    the options and arguments they set (values may differ per target)."""
    return {
        "name": app["name"],
        "route_prefix": app["route_prefix"],
        "import_path": app["import_path"],
        "args": {part: sorted(values) for part, values in app["args"].items()},
        "deployments": {name: sorted(opts) for name, opts in deployments(app).items()},
    }


@pytest.mark.parametrize(
    ("value_set", "path", "routers"),
    [
        ("default", SERVE_CONFIG, 1),
        ("two-routers", TWO_ROUTERS_CONFIG, 2),
        ("multinode", MULTINODE_CONFIG, 2),
    ],
    ids=["one-router", "two-routers", "multinode"],
)
def test_chart_and_local_config_describe_the_same_application(
    value_set: str, path: Path, routers: int
) -> None:
    chart_config = serve_config(rayservice(render(VALUE_SETS[value_set])))
    check_serve_config(chart_config, routers=routers)
    assert shape(the_app(chart_config)) == shape(the_app(local_config(path)))


CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "chart": lambda: serve_config(rayservice(render(WITH_KEYS))),
    "local": local_config,
    "two-routers": lambda: local_config(TWO_ROUTERS_CONFIG),
    "multinode": lambda: local_config(MULTINODE_CONFIG),
}


@pytest.mark.parametrize("source", list(CONFIGS))
def test_the_deadlines_end_a_slow_job_in_the_routers_shape_before_the_proxy_cuts_it(
    source: str,
) -> None:
    """Every config sets the data plane's deadlines (docs/reliability.md, "Deadlines"): Serve's
    proxy cuts a request later than the router's own job deadline ends it (a 504 in the
    route's shape, not the proxy's plain 408); an engine is taken for lost on missing load
    reports only after several polls; the routers are health-checked more tightly than the
    engines."""
    config = CONFIGS[source]()
    router = RouterConfig.model_validate(the_app(config)["args"]["router"])
    assert config["http_options"]["request_timeout_s"] > router.request_timeout_s
    assert router.replica_silence_s >= 3 * router.load_poll_interval_s
    options = deployments(the_app(config))
    for name in DEPLOYMENTS:
        assert options[name]["health_check_timeout_s"] >= options[name]["health_check_period_s"]
    assert (
        options["WiMRouter"]["health_check_timeout_s"]
        < options["EngineReplica"]["health_check_timeout_s"]
    )


@pytest.mark.parametrize("source", ["chart", "local", "two-routers", "multinode"])
def test_the_app_builds_with_the_configs_arguments(source: str) -> None:
    """build_app accepts the configs' args and names the deployments they configure."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as build

    from wim_service.serving.app import build_app

    app = the_app(CONFIGS[source]())
    # Through Serve's own builder call, as `serve run`/`serve deploy` make it.
    built = build(
        call_user_app_builder_with_args_if_necessary(build_app, app["args"]), name=app["name"]
    )
    assert {d.name for d in built.deployments} == DEPLOYMENTS
    assert built.ingress_deployment_name == "WiMRouter"
