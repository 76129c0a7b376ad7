"""The chart's network: no Service exposes Ray's control plane, and its NetworkPolicies let
through only what the service needs (evaluated on the rendered policies, as a CNI would)."""

from __future__ import annotations

from typing import Any

from tests.deploy.chart import (
    CLIENT,
    ELSEWHERE,
    INTERNET,
    KUBE_DNS,
    NEIGHBOUR,
    OPERATOR,
    PROMETHEUS,
    RAY_PORTS,
    REDIS,
    SERVE_PORT,
    VALUE_SETS,
    WITH_KEYS,
    allowed,
    by_kind,
    merged,
    rayservice,
    release_pods,
    render,
)


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
