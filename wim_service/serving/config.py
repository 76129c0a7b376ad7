"""Service configuration: what `build_app` takes from the serve config's `args`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from wim_service.engine.config import EngineConfig


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Document sessions end (and are purged) this long after their last use unless deleted.
    session_ttl_s: float = Field(600.0, gt=0, le=86400)
    max_session_ttl_s: float = Field(3600.0, gt=0)
    # Larger documents are refused with 413 before any tokenization.
    max_document_chars: int = Field(2_000_000, ge=1)
    # How often the router asks every engine replica for its load.
    load_poll_interval_s: float = Field(2.0, gt=0)
    # How long a request waits for a live engine replica (e.g. while a replacement starts).
    replica_wait_s: float = Field(120.0, ge=0)
    # Retries on another replica after the pinned one fails mid-request.
    max_failovers: int = Field(2, ge=0, le=10)
    # Retry-After sent with 429/503.
    retry_after_s: int = Field(5, ge=1)


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
