"""The chart's placement: the Ray worker groups and the resources that engine and router replicas
ask for, so that each replica can land only where it is meant to and every replica fits a pod."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr as autoscaler_view,
)

from tests.deploy.chart import (
    MULTINODE_CONFIG,
    NAMESPACE,
    PLACEMENT,
    RAY_PORTS,
    REDIS,
    RELEASE,
    SERVE_PORT,
    VALUE_SETS,
    WITH_KEYS,
    Endpoint,
    allowed,
    by_kind,
    deployments,
    local_config,
    merged,
    placement,
    pod_templates,
    rayservice,
    render,
    selects,
    serve_config,
    the_app,
)


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
