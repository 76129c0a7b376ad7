"""The Serve application as deployed: deploy/serve_config*.yaml are valid, on loopback, and the
same application as the chart's, with deadlines that end a slow job before the proxy does."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import (
    DEPLOYMENTS,
    MULTINODE_CONFIG,
    PLACEMENT,
    SERVE_CONFIG,
    TWO_ROUTERS_CONFIG,
    VALUE_SETS,
    WITH_KEYS,
    check_serve_config,
    deployments,
    local_config,
    placement,
    rayservice,
    render,
    serve_config,
    the_app,
)
from wim_service.engine.kv_transfer.documents import (
    STORE_ENV,
)
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.serving.config import RouterConfig


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
    engines; streamed answers' heartbeat is set, for the balancer's idle timeout to match it."""
    config = CONFIGS[source]()
    router = RouterConfig.model_validate(the_app(config)["args"]["router"])
    assert config["http_options"]["request_timeout_s"] > router.request_timeout_s
    assert "stream_heartbeat_s" in the_app(config)["args"]["router"]  # set, not defaulted
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
