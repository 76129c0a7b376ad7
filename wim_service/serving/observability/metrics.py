"""The service's Prometheus metrics (see docs/serving.md). vLLM's own `vllm:*` metrics are
re-exported beside them from every engine replica, with a `replica` label."""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from wim_service.serving.errors import STATUS
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import WiMEvent

# `*_created` timestamp series only double the exposition; nothing reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # (untyped in prometheus_client)

# Seconds buckets spanning a sub-second margin to a multi-minute document on CPU.
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)
# Event-loop lag: a healthy loop wakes within a millisecond or two; from a second on, requests
# and health checks visibly wait; 30 s and more is a stall (+Inf).
_LAG_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Every label value of the labelled counters (serving/routing/): each series is exported
# from the start.
FAILOVER_REASONS = ("replica_lost", "replica_left", "replica_silent", "session_missing")
BINDING_RESULTS = ("hit", "new", "repin", "rejected")  # routing.bindings.BindResult's
COPY_ROLES = ("primary", "copy")
# The router's maintenance loop's steps (`WiMRouter._maintain`).
MAINTENANCE_STEPS = ("loads", "expiry", "holds", "claims", "idle_copies", "kv_store")
# The codes cheapest-first admission refuses with (`ReplicaFleet.admit`).
ADMISSION_REFUSALS = (ErrorCode.OVERLOADED.value, ErrorCode.TOO_LONG.value)


# Why a restore loaded nothing (`engine/kv_transfer`); the document was read instead.
KV_FALLBACK_REASONS = ("missing", "mismatch", "digest", "tampered", "block_check", "store_down")
# Why a save stopped part-way (the document is read as usual; a later restore finds less).
KV_SAVE_FAILURES = ("store_down", "store_full")


class StoredKVMetrics:
    """An engine replica's stored document KV (`engine/kv_transfer`), counted where the reads
    and restores happen, once per read however many routers asked for it; they reach
    `/metrics` through the router with a `replica` label, beside `wim_kv_store_bytes`, which
    the router measures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.saved_tokens = Counter(
            "wim_kv_saved_tokens",
            "Document tokens whose KV was saved to the KV store as the document was read.",
            registry=registry,
        )
        self.restored_tokens = Counter(
            "wim_kv_restored_tokens",
            "Document tokens loaded from the KV store instead of computed.",
            registry=registry,
        )
        self.restore_seconds = Histogram(
            "wim_kv_restore_seconds",
            "Restoring a stored document: from its first push to the document in the KV cache.",
            buckets=_SECONDS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "wim_kv_restore_fallbacks",
            "Documents that had to be read again although a restore was asked: nothing usable "
            "was stored, by reason.",
            ["reason"],
            registry=registry,
        )
        self.save_failures = Counter(
            "wim_kv_save_failures",
            "Documents whose KV could not all be saved, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in KV_FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for reason in KV_SAVE_FAILURES:
            self.save_failures.labels(reason)


def event_loop_lag(registry: CollectorRegistry) -> Histogram:
    """`wim_event_loop_lag_seconds` in `registry`: the router's (`WiMMetrics`), and each engine
    replica's own, which reaches `/metrics` through the router (`vllm_metrics`)."""
    # A histogram rather than a gauge of the last window's maximum: its counts only grow, so a
    # stall stays in them until Prometheus scrapes, whatever the scrape interval, and the
    # largest lag of any window is `histogram_quantile(1, ...)` of them (WiMEventLoopStalled).
    # Not their p99: a stalled loop takes one sample per stall and a healthy one 4 a second, so
    # in 5 minutes a 2-minute stall is 1 sample beside 720 and no percentile but the top sees it.
    return Histogram(
        "wim_event_loop_lag_seconds",
        "How late the event loop woke from a fixed sleep, per process: deployment (router or "
        "replica) and its Serve replica.",
        ["deployment", "replica"],
        buckets=_LAG_SECONDS,
        registry=registry,
    )


class WiMMetrics:
    """One registry per router: every metric the service exports about WiM work."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._sessions(self.registry)
        self._latencies(self.registry)
        self._work(self.registry)
        self._copies(self.registry)
        self.event_loop_lag = event_loop_lag(self.registry)
        self._admission(self.registry)
        self.maintenance_failures = Counter(
            "wim_maintenance_failures",
            "Steps of the router's maintenance loop that failed (each is logged with its "
            "error); the loop goes on with the next step.",
            ["step"],  # MAINTENANCE_STEPS
            registry=self.registry,
        )
        self.metrics_renders = Counter(
            "wim_metrics_renders",
            "Pages of /metrics rendered: at most one per metrics_interval_s, however many "
            "scrapers come.",
            registry=self.registry,
        )
        # A labelled counter has no series until its first label: exported at 0 from the
        # start, a dashboard's error rate or failover count reads 0 before anything happened,
        # not "No data".
        for status in sorted({200, *STATUS.values()}):
            self.requests.labels(str(status))
        for reason in FAILOVER_REASONS:
            self.failover.labels(reason)
        for result in BINDING_RESULTS:
            self.binding.labels(result)
        for role in COPY_ROLES:
            self.copy_queries.labels(role)
        for step in MAINTENANCE_STEPS:
            self.maintenance_failures.labels(step)
        for code in ADMISSION_REFUSALS:
            self.admission_refused.labels(code)
        for relevant in ("true", "false"):
            for grounded in ("true", "false"):
                self.margins.labels(relevant, grounded)

    def _admission(self, r: CollectorRegistry) -> None:
        """Cheapest-first admission's refusals, water level and pace."""
        self.admission_refused = Counter(
            "wim_admission_refused",
            "Requests refused by cheapest-first admission, by code: overloaded (429), while "
            "the fleet was short, costlier than what the engines answer or past the request "
            "deadline at their pace; too_long (413), past the deadline at their pace with the "
            "fleet not short (docs/routing.md).",
            ["code"],  # ADMISSION_REFUSALS
            registry=r,
        )
        self.admission_level = Gauge(
            "wim_admission_water_level_seconds",
            "Cheapest-first admission's water level: arrivals costing more engine seconds "
            "are refused (+Inf while the fleet is not short, or the rule is off).",
            registry=r,
        )
        self.admission_level.set(math.inf)
        self.admission_pace = Gauge(
            "wim_admission_pace",
            "Engine seconds an estimated second takes, as the answers measured it (the 10th "
            "percentile of their engine time over their cost; NaN before ten answers): far "
            "from 1, the router's cost profile is not the engines' hardware.",
            registry=r,
        )
        self.admission_pace.set(math.nan)

    def _sessions(self, r: CollectorRegistry) -> None:
        """Requests, document sessions and the replicas' KV."""
        self.requests = Counter(
            "wim_requests", "WiM HTTP requests by outcome.", ["status"], registry=r
        )
        self.sessions_active = Gauge(
            "wim_sessions_active",
            "Document sessions holding KV, per replica.",
            ["replica"],
            registry=r,
        )
        self.resident_kv_tokens = Gauge(
            "wim_session_resident_kv_tokens",
            "Context tokens pinned in KV by document sessions, per replica.",
            ["replica"],
            registry=r,
        )
        self.binding = Counter(
            "wim_session_binding",
            "Session-to-replica binding decisions.",
            ["result"],  # BINDING_RESULTS
            registry=r,
        )
        self.kv_reserved_blocks = Gauge(
            "wim_kv_reserved_blocks",
            "KV blocks reserved by running jobs and document sessions, per replica.",
            ["replica"],
            registry=r,
        )
        self.replica_draining = Gauge(
            "wim_replica_draining",
            "1 while a replica takes no new sessions.",
            ["replica"],
            registry=r,
        )

    def _latencies(self, r: CollectorRegistry) -> None:
        self.segment_prefill_seconds = Histogram(
            "wim_segment_prefill_seconds",
            "Time to prefill one segment.",
            buckets=_SECONDS,
            registry=r,
        )
        self.margin_seconds = Histogram(
            "wim_margin_seconds",
            "Time from a margin's submission to its decision.",
            buckets=_SECONDS,
            registry=r,
        )
        self.query_ttft_seconds = Histogram(
            "wim_query_ttft_seconds",
            "Time from a query's arrival to its first answer token.",
            buckets=_SECONDS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "wim_request_seconds", "Whole request time.", buckets=_SECONDS, registry=r
        )

    def _work(self, r: CollectorRegistry) -> None:
        """Margins, failovers and the tokens they cost or save."""
        self.margins = Counter(
            "wim_margins",
            "Margins written, by relevance and by whether their own segment supports them.",
            ["relevant", "grounded"],
            registry=r,
        )
        self.margins_skipped = Counter(
            "wim_margins_skipped",
            "Segments whose margin was not written: no window of their sentences shares enough "
            "with the query for a note to be kept.",
            registry=r,
        )
        self.failover = Counter(
            "wim_session_failover",
            "Sessions moved off a failed replica.",
            ["reason"],
            registry=r,
        )
        self.reprefill_tokens = Counter(
            "wim_reprefill_tokens",
            "Context tokens read again from the document's text to rebuild a session elsewhere "
            "(none for a rebuild that restored the document's KV from the store).",
            registry=r,
        )
        self.kv_store_bytes = Gauge(
            "wim_kv_store_bytes",
            "Bytes of document KV in the KV store (engine/kv_transfer), as last measured; 0 "
            "without a store.",
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "wim_prefix_cache_hit_tokens",
            "Prompt tokens served from the KV/prefix cache.",
            registry=r,
        )

    def _copies(self, r: CollectorRegistry) -> None:
        """Copies of hot documents (`serving/routing/copies.py`): a document session's queries
        shared between the replica it was read on (its primary) and copies read elsewhere."""
        self.copies_opened = Counter(
            "wim_document_copies_opened",
            "Copies of document sessions read onto another replica, because the placement "
            "expected a query to start sooner there than on any replica holding the document.",
            registry=r,
        )
        self.copies_retired = Counter(
            "wim_document_copies_retired",
            "Copies closed after no query used them for copy_idle_s.",
            registry=r,
        )
        self.copy_queries = Counter(
            "wim_copy_queries",
            "Queries on document sessions, by the holder that ran them: the primary or a copy.",
            ["role"],  # COPY_ROLES
            registry=r,
        )
        self.document_copies = Gauge(
            "wim_document_copies",
            "Copies of document sessions open besides their primaries, as of the router's "
            "last listing of the session store.",
            registry=r,
        )


class JobObserver:
    """Turns one job's events into latency and margin metrics as they pass."""

    def __init__(self, metrics: WiMMetrics) -> None:
        self.metrics = metrics
        self.started = time.perf_counter()
        self._last_segment = self.started
        self._answered = False

    def observe(self, event: WiMEvent) -> None:
        now = time.perf_counter()
        if event.type == "segment":
            self.metrics.segment_prefill_seconds.observe(now - self._last_segment)
            self._last_segment = now
        elif event.type == "margin" and event.skipped:
            self.metrics.margins_skipped.inc()
        elif event.type == "margin":
            self.metrics.margin_seconds.observe(event.elapsed_s)
            self.metrics.margins.labels(
                str(event.relevant).lower(), str(event.grounded).lower()
            ).inc()
        elif event.type == "answer" and not self._answered:
            self._answered = True
            self.metrics.query_ttft_seconds.observe(now - self.started)
        elif event.type == "done":
            self.metrics.prefix_cache_hit_tokens.inc(event.usage.prompt_tokens_cached)

    def finish(self, status: str) -> None:
        self.metrics.requests.labels(status).inc()
        self.metrics.request_seconds.observe(time.perf_counter() - self.started)


# Family names as Prometheus exposes them (counters gain `_total`).
METRIC_NAMES = (
    "wim_requests_total",
    "wim_sessions_active",
    "wim_session_resident_kv_tokens",
    "wim_session_binding_total",
    "wim_segment_prefill_seconds",
    "wim_margin_seconds",
    "wim_query_ttft_seconds",
    "wim_request_seconds",
    "wim_margins_total",
    "wim_margins_skipped_total",
    "wim_session_failover_total",
    "wim_reprefill_tokens_total",
    "wim_prefix_cache_hit_tokens_total",
    "wim_replica_draining",
    "wim_kv_reserved_blocks",
    "wim_event_loop_lag_seconds",
    "wim_document_copies_opened_total",
    "wim_document_copies_retired_total",
    "wim_copy_queries_total",
    "wim_document_copies",
    "wim_metrics_renders_total",
    "wim_maintenance_failures_total",
    "wim_admission_refused_total",
    "wim_admission_water_level_seconds",
    "wim_kv_saved_tokens_total",
    "wim_kv_restored_tokens_total",
    "wim_kv_restore_seconds",
    "wim_kv_store_bytes",
    "wim_kv_restore_fallbacks_total",
    "wim_kv_save_failures_total",
)
