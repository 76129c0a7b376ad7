"""The chart's stores: several routers need the Redis session store, its URL and encryption key
come from Secrets, GCS fault tolerance uses Redis, and documents' KV is stored on a volume or
in Redis only when asked for."""

from __future__ import annotations

import base64
import json
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import (
    ENCRYPTION_SECRET,
    KV_CLAIM,
    KV_ENV,
    KV_KEY_SECRET,
    KV_MOUNT,
    REDIS,
    REDIS_URL_SECRET,
    TWO_ROUTERS,
    VALUE_SETS,
    WITH_KEYS,
    allowed,
    by_kind,
    deployments,
    env_of,
    merged,
    pod_templates,
    ray_containers,
    rayservice,
    release_pods,
    render,
    serve_config,
    the_app,
)
from wim_service.engine.kv_transfer import documents
from wim_service.engine.kv_transfer.documents import (
    STORE_ENV,
    DocumentKV,
)
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.engine.kv_transfer.redis_store import RedisKVStore
from wim_service.serving.config import RouterConfig


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
