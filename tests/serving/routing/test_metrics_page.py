"""`/metrics` as a public endpoint that costs the router the same however many scrape it:
`serving.routing.recent.Paced` renders the page at most once per `metrics_interval_s`, off
the event loop, shared by every scraper that waits for it; `metrics_require_key` puts it behind
an API key. The real-stack flood is in tests/live/test_metrics_flood.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from tests.fakes.replicas import FakeReplica
from tests.fakes.router import metric
from tests.serving.routing.test_recent import Counting
from tests.serving.routing.test_router_access import ACME, service
from wim_service.serving.observability.metrics import BINDING_RESULTS
from wim_service.serving.routing import router as router_module
from wim_service.serving.routing.bindings import BindResult
from wim_service.serving.routing.recent import Paced


def counted_renders() -> Counting:
    """A render that counts its calls, each one's result its number (the gate open)."""
    renders = Counting()
    renders.gate.set()
    return renders


async def test_callers_together_share_one_render_and_later_ones_get_a_new_one() -> None:
    renders = counted_renders()
    renders.gate.clear()
    paced = Paced(renders.fetch, interval_s=0)
    together = [asyncio.create_task(paced.get()) for _ in range(20)]
    await asyncio.sleep(0)
    renders.gate.set()
    assert await asyncio.gather(*together) == [1] * 20
    # A page rendered before a caller came is never its answer: whatever it did before
    # asking (a request counted, a gauge set) is in the page it gets.
    assert await paced.get() == 2 and renders.calls == 2


async def test_a_caller_during_a_render_waits_for_the_next_one() -> None:
    renders = counted_renders()
    renders.gate.clear()
    paced = Paced(renders.fetch, interval_s=0)
    first = asyncio.create_task(paced.get())
    await asyncio.sleep(0)  # the render has started (and waits on its gate)
    second = asyncio.create_task(paced.get())
    await asyncio.sleep(0)
    renders.gate.set()
    assert await first == 1 and await second == 2


async def test_a_flood_of_callers_gets_at_most_one_render_per_interval() -> None:
    renders = counted_renders()
    interval = 0.05
    paced = Paced(renders.fetch, interval_s=interval)
    pages = 0

    async def scrape_for(seconds: float) -> None:
        nonlocal pages
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await paced.get()
            pages += 1

    start = time.monotonic()
    await asyncio.gather(*(scrape_for(0.5) for _ in range(30)))
    elapsed = time.monotonic() - start
    # Renders start at least `interval` apart, however many callers and however slow the
    # machine: a bound on a count, not on a time.
    assert renders.calls <= elapsed / interval + 1
    assert pages >= 30 and pages >= 10 * renders.calls


async def test_a_caller_that_leaves_does_not_cancel_the_others_render() -> None:
    renders = counted_renders()
    renders.gate.clear()
    paced = Paced(renders.fetch, interval_s=0)
    leaving = asyncio.create_task(paced.get())
    staying = asyncio.create_task(paced.get())
    await asyncio.sleep(0)
    leaving.cancel()
    renders.gate.set()
    assert await staying == 1


async def test_concurrent_scrapes_share_one_render_made_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, router = service(FakeReplica("a"), FakeReplica("b"), metrics_interval_s=60)
    await router.ready_replicas()  # the router learns its replicas
    merge = router_module.merge_replica_metrics
    threads: list[int] = []

    def counted(*args: Any) -> str:
        threads.append(threading.get_ident())
        return merge(*args)

    monkeypatch.setattr(router_module, "merge_replica_metrics", counted)
    try:
        pages = await asyncio.gather(*(router.metrics_text() for _ in range(50)))
    finally:
        router.shutdown()
    assert len(threads) == 1 and threads[0] != threading.get_ident()
    assert len(set(pages)) == 1 and "wim_metrics_renders_total 1.0" in pages[0]
    assert 'vllm:num_requests_running{replica="b"}' in pages[0]


def test_a_scrape_sees_what_happened_before_it_even_within_the_interval() -> None:
    client, _ = service(metrics_interval_s=0.2)
    assert metric(client, "wim_requests_total", status="401") == 0
    assert client.post("/wim", json={"query": "q"}).status_code == 401
    assert metric(client, "wim_requests_total", status="401") == 1


def test_metrics_can_require_a_key() -> None:
    public, _ = service()
    assert public.get("/metrics").status_code == 200
    keyed, _ = service(metrics_require_key=True)
    refused = keyed.get("/metrics")
    assert refused.status_code == 401 and refused.json()["code"] == "unauthorized"
    page = keyed.get("/metrics", headers=ACME)
    assert page.status_code == 200 and "wim_requests_total" in page.text
    assert keyed.get("/healthz").status_code == 200  # the probes stay public


def test_counters_and_gauges_a_dashboard_divides_or_sums_read_zero_before_anything() -> None:
    """A labelled series exists from the start at 0: a dashboard's server-error share,
    failovers and draining replicas read 0 where nothing happened, not "No data"."""
    client, _ = service(FakeReplica("a"), FakeReplica("b"))
    assert client.get("/readyz").status_code == 200  # the router learns its replicas
    page = client.get("/metrics").text
    for series in (
        'wim_requests_total{status="500"} 0.0',
        'wim_requests_total{status="503"} 0.0',
        'wim_requests_total{status="429"} 0.0',
        'wim_session_failover_total{reason="replica_lost"} 0.0',
        'wim_session_failover_total{reason="replica_left"} 0.0',
        'wim_session_failover_total{reason="session_missing"} 0.0',
        'wim_replica_draining{replica="a"} 0.0',
        'wim_replica_draining{replica="b"} 0.0',
        'wim_session_binding_total{result="rejected"} 0.0',
        'wim_copy_queries_total{role="copy"} 0.0',
        'wim_margins_total{grounded="false",relevant="true"} 0.0',
    ):
        assert series in page.splitlines(), series


def test_the_binding_results_exported_at_zero_are_the_routers_own() -> None:
    assert set(BINDING_RESULTS) == {result.value for result in BindResult}
