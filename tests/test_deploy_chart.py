"""The Helm chart (helm/wim-service) and the local Serve config (deploy/serve_config.yaml).

The chart is rendered offline by Helm's own library (PyPI helm-python-sdk, no helm binary, no
cluster). Built-in kinds are validated with kubernetes-validate; the RayService against
KubeRay's ray.io/v1 fields, with its pod templates validated as core/v1 PodTemplates. Both
Serve configs are parsed by Ray Serve's own schema and must describe the same application.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from wim_service.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "wim-service"
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
KUBE_VERSION = "1.30.0"
RELEASE = "wim"
NAMESPACE = "wim-test"
MONITORING_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_worker_niceness": "0"}
DEPLOYMENTS = {"WiMRouter", "EngineReplica"}
# Fields of KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1/raycluster_types.go).
KUBERAY_FIELDS = {
    "RayClusterSpec": {
        "rayVersion",
        "enableInTreeAutoscaling",
        "autoscalerOptions",
        "headGroupSpec",
        "workerGroupSpecs",
        "headServiceAnnotations",
        "gcsFaultToleranceOptions",
        "suspend",
        "managedBy",
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
    "HeadGroupSpec": {"rayStartParams", "template", "serviceType", "headService", "enableIngress"},
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
    },
}


def gpu_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values-gpu.yaml").read_text())


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest the chart renders with `values`, parsed."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
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


def the_app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def deployments(app: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in app["deployments"]}


VALUE_SETS = {"default": None, "gpu": gpu_values(), "monitoring": MONITORING_ON}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def manifests(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(VALUE_SETS[request.param])


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
    builtin = [m for m in manifests if m["apiVersion"] in ("v1", "apps/v1")]
    assert {m["kind"] for m in builtin} >= {"Service", "Pod"}
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
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    (worker,) = cluster["workerGroupSpecs"]
    # The API server prunes fields a CRD does not know without a word: no typos.
    assert set(cluster) <= KUBERAY_FIELDS["RayClusterSpec"]
    assert set(cluster["autoscalerOptions"]) <= KUBERAY_FIELDS["AutoscalerOptions"]
    assert set(head) <= KUBERAY_FIELDS["HeadGroupSpec"]
    assert set(worker) <= KUBERAY_FIELDS["WorkerGroupSpec"]
    # ...and the ones its CRD requires (rayStartParams too, before KubeRay 1.1).
    assert {"template", "rayStartParams"} <= set(head)
    assert {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"} <= set(worker)
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
    for group in (head, worker):
        # KubeRay's CRD: rayStartParams is map[string]string; one container per Ray pod.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"].startswith("wim-service:")
    assert head["rayStartParams"]["num-cpus"] == "0"
    head_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    # KubeRay builds <name>-serve-svc from the head container's port named "serve".
    assert head_ports["serve"] == 8000
    assert head_ports["gcs-server"] == 6379


def test_every_ray_container_runs_offline_at_normal_priority(
    manifests: list[dict[str, Any]],
) -> None:
    for _, template in pod_templates(rayservice(manifests)):
        spec = template["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert OFFLINE_ENV.items() <= env.items()
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_serve_config_v2_is_a_valid_serve_config(manifests: list[dict[str, Any]]) -> None:
    config = serve_config(rayservice(manifests))
    check_serve_config(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}


def test_gpu_values_switch_image_and_ask_for_gpus() -> None:
    service = rayservice(render(gpu_values()))
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
    kinds = {m["kind"] for m in render()}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}
    manifests = render(MONITORING_ON)
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
    manifests = render(MONITORING_ON)
    (rule,) = by_kind(manifests, "PrometheusRule")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "wim-alerts.yaml").read_text())
    assert rule["spec"] == alerts
    (dashboard,) = by_kind(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    shipped = json.loads((ROOT / "deploy" / "grafana" / "wim-service-dashboard.json").read_text())
    assert json.loads(text) == shipped


def test_service_monitor_without_metrics_service_is_refused() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.service\.enabled"):
        render(values)


@pytest.mark.parametrize(
    "values",
    [
        {"serve": {"application": {"args": {"engine": {"kv_cache_gibs": 1}}}}},
        {"serve": {"application": {"args": {"engine": {"block_size": 40}}}}},
        {"worker": {"rayStartParams": {"num-cpus": 4}}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"serve": {"application": {"deployments": {"EngineReplica": {"name": "Other"}}}}},
        {"unknownTopLevel": True},
    ],
    ids=["engine-typo", "block-size", "non-string-ray-param", "pull-policy", "renamed", "top"],
)
def test_values_schema_refuses_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_values_schema_names_every_engine_config_field() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["definitions"]["engine"]["properties"]) == set(EngineConfig.model_fields)


def test_notes_curl_the_serve_service() -> None:
    text = notes()
    # `helm install wim` names the RayService "wim"; KubeRay names its Service wim-serve-svc.
    assert f"svc/{RELEASE}-serve-svc 8000:8000" in text
    assert "curl -fsS http://127.0.0.1:8000/readyz" in text
    body = text.split("-d '", 1)[1].split("'", 1)[0]
    assert set(json.loads(body)) == {"context", "query"}


# --- the Serve application, in the chart and in deploy/serve_config.yaml -----------------------


def check_serve_config(config: dict[str, Any]) -> None:
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
    assert options["WiMRouter"]["num_replicas"] == 1
    assert options["WiMRouter"]["ray_actor_options"]["num_cpus"] == 0
    scaling = options["EngineReplica"]["autoscaling_config"]
    assert {"min_replicas", "max_replicas", "target_ongoing_requests"} <= set(scaling)
    # A replica leaving on scale-down lets a whole running job finish (minutes on CPU).
    assert options["EngineReplica"]["graceful_shutdown_timeout_s"] >= 120
    EngineConfig.model_validate(app["args"]["engine"])


def local_config() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def test_local_serve_config_is_valid_and_stays_on_loopback() -> None:
    config = local_config()
    check_serve_config(config)
    assert config["http_options"]["host"] == "127.0.0.1"
    scaling = deployments(the_app(config))["EngineReplica"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)


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


def test_chart_and_local_config_describe_the_same_application() -> None:
    chart_app = the_app(serve_config(rayservice(render())))
    assert shape(chart_app) == shape(the_app(local_config()))


@pytest.mark.skipif(
    importlib.util.find_spec("wim_service.serving.app") is None,
    reason="wim_service.serving.app is not in this tree yet",
)
@pytest.mark.parametrize("source", ["chart", "local"])
def test_the_app_builds_with_the_configs_arguments(source: str) -> None:
    """build_app accepts both configs' args and names the deployments they configure."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as build

    from wim_service.serving.app import build_app

    config = serve_config(rayservice(render())) if source == "chart" else local_config()
    app = the_app(config)
    # Through Serve's own builder call, as `serve run`/`serve deploy` make it.
    built = build(
        call_user_app_builder_with_args_if_necessary(build_app, app["args"]), name=app["name"]
    )
    assert {d.name for d in built.deployments} == DEPLOYMENTS
    assert built.ingress_deployment_name == "WiMRouter"
