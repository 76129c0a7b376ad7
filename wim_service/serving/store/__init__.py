"""Where the router keeps document sessions: in its own process, or in Redis for several routers.

`make_store(config)` picks the backend named by `RouterConfig.store`; both keep the same
promises (`base.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from wim_service.serving.config import StoreConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.store.base import (
    Holding,
    SessionExists,
    SessionStore,
    StoredSession,
    StoreUnavailable,
)
from wim_service.serving.store.memory import MemorySessionStore
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [
    "Holding",
    "MemorySessionStore",
    "SessionExists",
    "SessionStore",
    "StoreUnavailable",
    "StoredSession",
    "make_store",
    "reachable",
]


def make_store(config: StoreConfig) -> SessionStore:
    if config.backend == "redis":
        # Imported here: a single router with the memory store needs no Redis client.
        from wim_service.serving.store.redis_store import RedisSessionStore

        return RedisSessionStore.from_env(config)
    return MemorySessionStore(config.tombstone_ttl_s)


async def reachable(call: Awaitable[T], what: str, retry_after_s: float) -> T:
    """`call`'s result, or 503 `unavailable` with Retry-After if the store cannot be reached:
    new work fails closed rather than run unchecked or unrecorded. `what` names what is
    unavailable in the answer."""
    try:
        return await call
    except StoreUnavailable as exc:
        logger.warning("session store unavailable: %s", exc)
        raise ServiceError(
            ErrorCode.UNAVAILABLE, f"{what} unavailable for a moment; retry later", retry_after_s
        ) from exc
