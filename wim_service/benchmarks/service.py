"""`wim bench --serving`: what the service adds and saves, measured side by side in one run.

(e) REST end to end vs the same job on an in-process engine (same engine settings);
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

PORT = 8799


def _start(engine: dict[str, Any], replicas: int) -> httpx.Client:
    from ray import serve

    from wim_service.serving.app import assemble
    from wim_service.serving.config import ServiceConfig

    serve.run(
        assemble(
            ServiceConfig.model_validate({"engine": engine}),
            engine_options={"num_replicas": replicas},
        ),
        name="wim",
        route_prefix="/",
        blocking=False,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=900)
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

    from wim_service.engine.vllm_engine import VLLMBackend

    document = settings.document()
    options = settings.options()
    wire_options = options.model_dump(include={"segment_tokens"})
    # Two engines share the machine in (f) and (g): keep each one's KV small.
    config = settings.engine.model_copy(
        update={"kv_cache_gib": min(settings.engine.kv_cache_gib, 0.5)}
    )
    engine = config.model_dump()
    results: dict[str, Any] = {}
    settings.header("wim bench --serving")

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        print("(e) REST end to end vs in-process engine, same job and engine settings")
        client = _start(engine, 1)
        local = VLLMBackend.start(config)
        try:
            await timed_job(local, document, QUERIES[0], options)  # warm-up, both sides
            _post(
                client, "/wim", {"context": document, "query": QUERIES[0], "options": wire_options}
            )
            rest_s, local_s = [], []
            for r in range(settings.rounds):
                query = QUERIES[r % len(QUERIES)]
                local_s.append((await timed_job(local, document, query, options)).seconds)
                body = {"context": document, "query": query, "options": wire_options}
                rest_s.append(_post(client, "/wim", body)[0])
        finally:
            local.shutdown()
        ratio = statistics.median(r / x for r, x in zip(rest_s, local_s, strict=True))
        results["e_rest_vs_local"] = {
            "rest_s": statistics.median(rest_s),
            "local_s": statistics.median(local_s),
            "ratio": ratio,
        }
        line(
            "REST / in-process",
            f"{statistics.median(rest_s):.2f} s / {statistics.median(local_s):.2f} s = {ratio:.3f}",
        )
        client.close()

        print("(f) query on a pinned document session vs the same query one-shot")
        client = _start({**engine, "cpu_threads_bind": "rank"}, 2)
        _, doc = _post(client, "/documents", {"context": document, "options": wire_options})
        session_s, oneshot_s, served = [], [], []
        for r in range(settings.rounds):
            query = QUERIES[r % len(QUERIES)]
            seconds, answer = _post(
                client, "/wim", {"document_id": doc["document_id"], "query": query}
            )
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
            sticky.append(
                _post(client, "/wim", {"document_id": doc["document_id"], "query": query})[1]
            )
            loose.append(
                _post(
                    client, "/wim", {"context": document, "query": query, "options": wire_options}
                )[1]
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
    finally:
        serve.shutdown()
        ray.shutdown()
    settings.save(results)
    return 0
