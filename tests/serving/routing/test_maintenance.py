"""The router's maintenance loop (`WiMRouter._maintain`) over fake replicas: a step that fails
is logged with its step and counted in `wim_maintenance_failures_total{step}`, and the loop goes
on with the next step; every step's counter is exported at 0 from the router's start."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.replicas import FakeClient, FakeReplica
from wim_service.serving.errors import ServiceError
from wim_service.serving.observability.metrics import MAINTENANCE_STEPS
from wim_service.serving.routing.router import WiMRouter
from wim_service.wim.errors import ErrorCode

COUNTER = "wim_maintenance_failures_total"


def router() -> WiMRouter:
    config = {"router": {"metrics_interval_s": 0}}
    return WiMRouter(None, config, client=FakeClient(FakeReplica("a")), http_host="127.0.0.1")


async def failures(wim_router: WiMRouter) -> dict[str, float]:
    """`wim_maintenance_failures_total` by step, as `/metrics` shows it."""
    text = await wim_router.metrics_text()
    return {
        sample.labels["step"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == COUNTER
    }


async def test_every_maintenance_step_is_counted_from_zero() -> None:
    """A counter first seen at 1 has no increase() for an alert to see: each step's series is
    there at 0 before anything failed, for each step the loop runs."""
    wim_router = router()
    try:
        assert set(wim_router._maintenance_steps()) == set(MAINTENANCE_STEPS)
        assert await failures(wim_router) == dict.fromkeys(MAINTENANCE_STEPS, 0.0)
    finally:
        wim_router.shutdown()


async def test_a_failing_maintenance_step_is_logged_counted_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wim_router = router()
    claimed = asyncio.Event()

    async def expired() -> list[object]:
        raise RuntimeError("the expiry scan broke")

    async def renew_held() -> None:
        raise ServiceError(ErrorCode.UNAVAILABLE, "the session store is unavailable")

    async def claim() -> None:
        claimed.set()

    # The loop's expiry and holds steps fail; the claims after them still run.
    wim_router.documents.expired = expired  # type: ignore[method-assign]
    wim_router.documents.renew_held = renew_held  # type: ignore[method-assign]
    wim_router._claim_documents = claim  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="wim_service.serving.routing.router")
    try:
        wim_router._start_background()
        await claimed.wait()
        counted = await failures(wim_router)
    finally:
        wim_router.shutdown()
    assert counted == {**dict.fromkeys(MAINTENANCE_STEPS, 0.0), "expiry": 1.0, "holds": 1.0}
    logged = [r for r in caplog.records if r.name == "wim_service.serving.routing.router"]
    assert [r.getMessage() for r in logged] == [
        "maintenance step expiry failed: the expiry scan broke",
        "maintenance step holds failed: the session store is unavailable",
    ]
    # A bug's traceback is logged; a store that is down says enough in its message.
    assert [bool(r.exc_info) for r in logged] == [True, False]
