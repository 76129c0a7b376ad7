"""Service configuration: what `build_app` takes from the serve config's `args`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from wim_service.engine.config import EngineConfig
from wim_service.placement.admission import (
    DEFAULT_CHEAPEST_FIRST,
    DEFAULT_SHORT_ARRIVALS,
    DEFAULT_SHORT_S,
    DEFAULT_SLACK,
    DEFAULT_WINDOW_ARRIVALS,
    DEFAULT_WINDOW_S,
)
from wim_service.placement.copies import DEFAULT_COPY_IDLE_S
from wim_service.placement.policy import DEFAULT_MAX_COPIES, policy_name
from wim_service.placement.polls import DEFAULT_LOAD_POLL_S
from wim_service.placement.profile import EngineProfile


class StoreConfig(BaseModel):
    """Where document sessions live (`serving/store/`). Secrets never come from here: the Redis
    URL is the env `WIM_REDIS_URL`, the document encryption key `WIM_STORE_ENCRYPTION_KEY`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # memory: in this router process (one router). redis: shared by every router replica.
    backend: Literal["memory", "redis"] = "memory"
    # Prefix of every Redis key, so that several services can share one Redis.
    key_prefix: str = Field("wim:", min_length=1)
    # A Redis that does not connect or answer within these is unavailable (HTTP 503).
    connect_timeout_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    # A call that Redis did not run because it refused the connection or was still loading its
    # data (a restart) is tried again for up to this long, so that a supervisor's restart of
    # Redis holds requests instead of refusing them. A Redis that stays away costs each new
    # request this long before its 503; 0 refuses at once.
    outage_wait_s: float = Field(10.0, ge=0, le=120)
    # An expired session's keys stay this long after its expiry, so that a router can still
    # close its KV on the bound replica; Redis drops them after that anyway.
    expiry_grace_s: float = Field(60.0, ge=0)
    # A deleted session's id cannot be created or bound again for this long.
    tombstone_ttl_s: float = Field(600.0, gt=0)


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Document sessions end (and are purged) this long after their last use unless deleted.
    session_ttl_s: float = Field(600.0, gt=0, le=86400)
    max_session_ttl_s: float = Field(3600.0, gt=0)
    # Larger documents are refused with 413 before any tokenization.
    max_document_chars: int = Field(2_000_000, ge=1)
    # Larger request bodies are refused with 413 before they are read (Content-Length) or as
    # soon as a chunked body passes it.
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    # A request's whole body must arrive within this long of its headers, or it is answered
    # 408 `body_timeout` and its connection closed (serving/http/edge.py).
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    # A job still running after this long is stopped (504 `deadline_exceeded`, or an `error`
    # event once streaming).
    request_timeout_s: float = Field(900.0, gt=0)
    # A streamed answer sends an SSE comment (`: keep-alive`) after this long without a frame,
    # and starts its stream once its job's first event is this late (a failure is then an
    # `error` event, not a status): clients and balancers may then give up on a stream silent
    # for a few of these instead of waiting as long as the longest job (docs/serving.md).
    stream_heartbeat_s: float = Field(2.0, gt=0, le=60)
    # How often the router asks every engine replica for its load.
    load_poll_interval_s: float = Field(DEFAULT_LOAD_POLL_S, gt=0)
    # `/metrics` is rendered at most once per this long, however many scrapers come; each
    # waits for a page rendered after its request arrived (so at most this long).
    metrics_interval_s: float = Field(1.0, ge=0, le=60)
    # `/metrics` takes an API key (any tenant's, counted against its request rate) instead of
    # being public, for deployments whose scrape port others can reach (docs/security.md).
    metrics_require_key: bool = False
    # How long a request waits for a live engine replica (e.g. while a replacement starts).
    replica_wait_s: float = Field(120.0, ge=0)
    # An engine replica that answers no load call for this long is taken for lost: the calls
    # open on it end and fail over, and no work goes there until it answers one again. What
    # ends a call on a dead replica while the GCS is down (Ray cannot say it died then); too
    # short, and a replica whose event loop stalls that long under load is failed over for
    # nothing (its jobs start again elsewhere). Keep it several `load_poll_interval_s`.
    replica_silence_s: float = Field(8.0, gt=0)
    # A replica closes a document session that no router has claimed for this long (routers
    # claim theirs every load poll): what a router that is gone leaves behind is reclaimed.
    orphan_timeout_s: float = Field(60.0, gt=0)
    # Retries on another replica after the pinned one fails mid-request.
    max_failovers: int = Field(2, ge=0, le=10)
    # Retry-After sent with 429/503.
    retry_after_s: int = Field(5, ge=1)
    # A running job counts against its tenant's `concurrent_jobs` as a lease in the session
    # store, renewed every third of this while the job runs: the jobs of a router that died
    # stop counting at most this long after it.
    job_lease_s: float = Field(30.0, gt=0)
    # When at most this fraction of the fleet's session slots is free, a new document session
    # goes only to a tenant under its fair share (serving/routing/quotas.py, docs/security.md).
    fair_share_headroom: float = Field(0.25, ge=0, lt=1)
    # OpenAI-API prompts (chat template included) with fewer tokens than this are answered by
    # one plain engine request; longer ones with a document run WiM (docs/openai.md).
    plain_prompt_tokens: int = Field(1024, ge=0)
    # A plain request without `max_tokens` answers at most this many tokens (fewer if the
    # context window leaves less): it reserves KV for all of them while it runs.
    plain_max_tokens: int = Field(1024, ge=1)
    # PDF uploads (`POST /extract/pdf`) are read in a worker process (serving/http/pdf.py): more
    # pages than this are refused (413 `too_long`), as is more text than max_document_chars.
    pdf_max_pages: int = Field(500, ge=1)
    # A worker still reading after this long (its start-up included) is killed: 422
    # `too_complex`.
    pdf_timeout_s: float = Field(10.0, gt=0, le=600)
    # The worker's address space; pypdf's allocations past it fail: 422 `too_complex`. Python
    # and pypdf take about 60 MiB of it before the PDF is read.
    pdf_max_memory_bytes: int = Field(512 * 2**20, ge=128 * 2**20)
    # PDF workers one router runs at once, over every tenant (each tenant's are also counted
    # among its concurrent jobs): past it 429 `overloaded` with Retry-After. Each worker takes
    # a core and up to `pdf_max_memory_bytes`.
    pdf_max_workers: int = Field(4, ge=1)
    # Where new work runs (wim_service/placement/): `expected_wait` sends each job where it is
    # expected to start soonest (work queued there, prefill it would still do) and copies a
    # hot document onto another replica when that is quicker; `sticky` keeps a document on
    # the replica it was read on and puts new work where most KV is free; `round_robin` takes
    # turns. `wim`, its old name, still means `expected_wait` (a deprecation line is logged).
    placement: Literal["expected_wait", "sticky", "round_robin"] = "expected_wait"
    # Replicas a document session may hold copies on at once, its first one included (1: a
    # document is never copied).
    max_copies: int = Field(DEFAULT_MAX_COPIES, ge=1, le=64)
    # A copy no query used for this long is closed (never a session's last one).
    copy_idle_s: float = Field(DEFAULT_COPY_IDLE_S, gt=0)
    # The engine cost profile the `expected_wait` placement and the replicas' backlogs are
    # computed with (`wim calibrate` measures one); unset: the profile shipped with the
    # service.
    cost_profile: str | None = None
    # Whether placement charges a copy or a rebuild of a document read before what restoring
    # its saved KV costs (the profile's `restore`) instead of a re-read: None (the default)
    # when the service has a KV store (env WIM_KV_STORE, which the router's deletes read
    # too; docs/kv-store.md). False for a store that often misses (a bound far below the
    # documents held): its copies then cost a re-read after the failed restore.
    restore_copies: bool | None = None
    # With `expected_wait`: once the fleet has been short for `cheapest_first_short_s` and
    # `cheapest_first_short_arrivals` arrivals (placements finding no room, or jobs stopped
    # at the deadline, never that far apart), arrivals costlier than what the engines
    # answered over the last `cheapest_first_window_s` (and at least the last
    # `cheapest_first_window_arrivals` arrivals; times `cheapest_first_slack`) are refused
    # first (429 with Retry-After), so that the engines answer more of the cheaper work
    # (wim_service/placement/admission.py, docs/routing.md). False: only what finds no room
    # is refused.
    cheapest_first: bool = DEFAULT_CHEAPEST_FIRST
    cheapest_first_window_s: float = Field(DEFAULT_WINDOW_S, gt=0, le=3600)
    cheapest_first_short_s: float = Field(DEFAULT_SHORT_S, gt=0, le=3600)
    cheapest_first_slack: float = Field(DEFAULT_SLACK, gt=0, le=100)
    cheapest_first_window_arrivals: int = Field(DEFAULT_WINDOW_ARRIVALS, ge=0, le=100_000)
    cheapest_first_short_arrivals: int = Field(DEFAULT_SHORT_ARRIVALS, ge=0, le=100_000)
    # Where document sessions (text, options, binding, expiry) live.
    store: StoreConfig = Field(default_factory=StoreConfig)

    @field_validator("placement", mode="before")
    @classmethod
    def _current_policy_name(cls, name: object) -> object:
        return policy_name(name) if isinstance(name, str) else name

    @field_validator("cost_profile")
    @classmethod
    def _profile_loads(cls, path: str | None) -> str | None:
        """A profile that cannot be read is refused with the config, not at the first job."""
        if path is not None:
            try:
                EngineProfile.load(Path(path))
            except (OSError, ValueError) as exc:  # (a ValidationError is a ValueError)
                raise ValueError(f"cost_profile {path!r} is not a readable profile: {exc}") from exc
        return path


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
