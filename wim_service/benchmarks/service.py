"""`wim bench --serving`: what the service adds and saves, measured side by side in one run.

(e) REST end to end vs the same job on an in-process engine (same engine settings), with the
    router's session store in process and in Redis;
(f) a query on a pinned document session vs the same query as a one-shot job: document tokens
    served from the pinned KV, and the wall-time ratio;
(g) sticky routing vs no affinity for multi-query sessions on two replicas: prompt tokens
    computed per query (without affinity every query reads the document again).

Everything runs on this machine: local Ray, loopback HTTP, bounded rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import httpx

from wim_service.benchmarks.common import QUERIES, BenchSettings, line, timed_job
from wim_service.benchmarks.store import redis_url
from wim_service.engine.config import EngineConfig
from wim_service.wim.options import WiMOptions

PORT = 8799


def _start(
    engine: dict[str, Any], replicas: int, router: dict[str, Any] | None = None, name: str = "wim"
) -> httpx.Client:
    """The application `name` at `/name` (`/` for "wim"), ready with `replicas` engines."""
    from ray import serve

    from wim_service.serving.app import assemble
    from wim_service.serving.config import ServiceConfig

    prefix = "/" if name == "wim" else f"/{name}"
    serve.run(
        assemble(
            ServiceConfig.model_validate({"engine": engine, "router": router or {}}),
            engine_options={"num_replicas": replicas},
        ),
        name=name,
        route_prefix=prefix,
        blocking=False,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}{prefix.rstrip('/')}", timeout=900)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        ready = client.get("/readyz")
        if ready.status_code == 200 and len(ready.json()["replicas"]) == replicas:
            return client
        time.sleep(2)
    raise RuntimeError(f"the service did not get {replicas} ready replicas")


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = client.post(path, json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


async def run_serving_bench(settings: BenchSettings) -> int:
    os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 (Ray reads this exact name)
    import ray
    from ray import serve

    document = settings.document()
    options = settings.options
    # Three engines share the machine in (e), two in (f) and (g): keep each one's KV small.
    config = settings.engine.model_copy(
        update={"kv_cache_gib": min(settings.engine.kv_cache_gib, 0.5)}
    )
    engine = config.model_dump()
    results: dict[str, Any] = {}
    settings.header("wim bench --serving")

    with redis_url() as url:
        # Every replica's environment: the Redis-backed router of (e) finds its store there.
        ray.init(
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"WIM_REDIS_URL": url}},
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": PORT})
            await _bench_rest(settings, config, document, options, results)
            serve.delete("wim-redis")
            _bench_sessions(settings, engine, document, results)
        finally:
            serve.shutdown()
            ray.shutdown()
    settings.save(results)
    return 0


async def _bench_rest(
    settings: BenchSettings,
    config: EngineConfig,
    document: str,
    options: WiMOptions,
    results: dict[str, Any],
) -> None:
    """(e): rounds alternate in-process, REST with the in-process store, REST with Redis."""
    from wim_service.engine.vllm_engine import VLLMBackend

    print("(e) REST end to end vs in-process engine, same job and engine settings")
    engine = config.model_dump()
    wire_options = settings.wire_options()
    redis_store = {"store": {"backend": "redis", "key_prefix": f"wim-bench-{os.getpid()}:"}}
    clients = {
        "memory": _start(engine, 1),
        "redis": _start(engine, 1, router=redis_store, name="wim-redis"),
    }
    local = VLLMBackend.start(config)
    seconds: dict[str, list[float]] = {"local": [], "memory": [], "redis": []}
    try:
        await timed_job(local, document, QUERIES[0], options)  # warm-up, every side
        for client in clients.values():
            body = {"context": document, "query": QUERIES[0], "options": wire_options}
            _post(client, "/wim", body)
        for r in range(settings.rounds):
            query = QUERIES[r % len(QUERIES)]
            seconds["local"].append((await timed_job(local, document, query, options)).seconds)
            for store, client in clients.items():
                body = {"context": document, "query": query, "options": wire_options}
                seconds[store].append(_post(client, "/wim", body)[0])
    finally:
        local.shutdown()
        for client in clients.values():
            client.close()
    local_s = statistics.median(seconds["local"])
    results["e_rest_vs_local"] = {"local_s": local_s}
    for store in clients:
        ratio = statistics.median(
            r / x for r, x in zip(seconds[store], seconds["local"], strict=True)
        )
        rest_s = statistics.median(seconds[store])
        results["e_rest_vs_local"][store] = {"rest_s": rest_s, "ratio": ratio}
        line(
            f"REST ({store} session store) / in-process",
            f"{rest_s:.2f} s / {local_s:.2f} s = {ratio:.3f}",
        )


def _bench_sessions(
    settings: BenchSettings, engine: dict[str, Any], document: str, results: dict[str, Any]
) -> None:
    """(f) and (g), on two engine replicas."""
    wire_options = settings.wire_options()
    print("(f) query on a pinned document session vs the same query one-shot")
    client = _start({**engine, "cpu_threads_bind": "rank"}, 2)
    _, doc = _post(client, "/documents", {"context": document, "options": wire_options})
    session_s, oneshot_s, served = [], [], []
    for r in range(settings.rounds):
        query = QUERIES[r % len(QUERIES)]
        seconds, answer = _post(client, "/wim", {"document_id": doc["document_id"], "query": query})
        session_s.append(seconds)
        usage = answer["usage"]
        # Document tokens computed again = computed beyond the query's own minimum.
        recomputed = max(0, usage["prompt_tokens_computed"] - usage["minimal_prompt_tokens"])
        served.append(1 - recomputed / doc["context_tokens"])
        body = {"context": document, "query": query, "options": wire_options}
        oneshot_s.append(_post(client, "/wim", body)[0])
    results["f_session_vs_oneshot"] = {
        "document_tokens_served_from_pinned_kv": min(served),
        "session_s": statistics.median(session_s),
        "oneshot_s": statistics.median(oneshot_s),
        "ratio": statistics.median(s / o for s, o in zip(session_s, oneshot_s, strict=True)),
    }
    f = results["f_session_vs_oneshot"]
    line(
        "document tokens served from the pinned KV (worst query)",
        f"{100 * f['document_tokens_served_from_pinned_kv']:.1f}%",
    )
    line(
        "session query / one-shot job",
        f"{f['session_s']:.2f} s / {f['oneshot_s']:.2f} s = {f['ratio']:.3f}",
    )

    print("(g) sticky routing vs no affinity, multi-query sessions on 2 replicas")
    sticky, loose = [], []
    for r in range(settings.rounds):
        query = QUERIES[r % len(QUERIES)]
        sticky.append(_post(client, "/wim", {"document_id": doc["document_id"], "query": query})[1])
        loose.append(
            _post(client, "/wim", {"context": document, "query": query, "options": wire_options})[1]
        )
    per_query = {
        name: statistics.mean(a["usage"]["prompt_tokens_computed"] for a in answers)
        for name, answers in (("sticky", sticky), ("no_affinity", loose))
    }
    results["g_sticky_vs_no_affinity"] = {
        **per_query,
        "replicas_used_without_affinity": sorted({a["replica"] for a in loose}),
    }
    line(
        "prompt tokens computed per query: sticky / no affinity",
        f"{per_query['sticky']:.0f} / {per_query['no_affinity']:.0f} = "
        f"{per_query['sticky'] / per_query['no_affinity']:.3f}",
    )
    client.delete(f"/documents/{doc['document_id']}")
    client.close()
