"""The Helm chart (helm/wim-service) and the local Serve configs (deploy/serve_config*.yaml).

The chart is rendered offline by Helm's own library (PyPI helm-python-sdk, no helm binary, no
cluster). Built-in kinds are validated with kubernetes-validate; the RayService against
KubeRay's ray.io/v1 fields, with its pod templates validated as core/v1 PodTemplates. The
NetworkPolicies are evaluated with Kubernetes' rules against the pods that would talk to the
release. The Serve configs are parsed by Ray Serve's own schema and must describe the same
application.
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    KUBE_VERSION,
    KUBERAY_FIELDS,
    OFFLINE_ENV,
    RAY_RESOURCE_PARAMS,
    RELEASE,
    ROOT,
    VALUE_SETS,
    WITH_KEYS,
    by_kind,
    check_serve_config,
    deployments,
    env_of,
    merged,
    notes,
    pod_templates,
    ray_containers,
    rayservice,
    render,
    serve_config,
    the_app,
)
from wim_service.engine.config import EngineConfig

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
    assert set(spec) <= {
        "serveConfigV2",
        "rayClusterConfig",
        "upgradeStrategy",
        "excludeHeadPodFromServeSvc",
    }
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


# --- network: Services and NetworkPolicies ------------------------------------------------------


# --- the session store and GCS fault tolerance --------------------------------------------------


# --- stored document KV -----------------------------------------------------------------------


# --- placement: worker groups and the resources replicas ask for --------------------------------


# --- the Serve application, in the chart and in deploy/serve_config*.yaml ---------------------


def test_the_serve_service_leaves_the_head_out_unless_told() -> None:
    """Clients reach the workers' proxies only (docs/reliability.md, the head away)."""
    assert rayservice(render(WITH_KEYS))["spec"]["excludeHeadPodFromServeSvc"] is True
    kept = render(merged(WITH_KEYS, {"serveServiceExcludesHead": False}))
    assert rayservice(kept)["spec"]["excludeHeadPodFromServeSvc"] is False
