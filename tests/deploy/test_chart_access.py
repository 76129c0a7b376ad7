"""The chart's access control: the API keys' Secret, Ray's token authentication, and pods that
run as non-root on read-only filesystems without capabilities or service-account tokens."""

from __future__ import annotations

import base64
import re
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import (
    KEYS_FILE,
    KEYS_SECRET,
    KV_CLAIM,
    KV_MOUNT,
    OPEN,
    RELEASE,
    ROOT,
    VALUE_SETS,
    WITH_KEYS,
    by_kind,
    env_of,
    merged,
    notes,
    pod_templates,
    ray_containers,
    rayservice,
    render,
)


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
