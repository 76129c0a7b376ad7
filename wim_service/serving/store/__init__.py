"""Where the router keeps document sessions: in its own process, or in Redis for several routers.

`make_store(config)` picks the backend named by `RouterConfig.store`; both keep the same
promises (`base.py`).
"""

from __future__ import annotations

from wim_service.serving.config import StoreConfig
from wim_service.serving.store.base import (
    SessionExists,
    SessionStore,
    StoredSession,
    StoreUnavailable,
)
from wim_service.serving.store.memory import MemorySessionStore

__all__ = [
    "MemorySessionStore",
    "SessionExists",
    "SessionStore",
    "StoreUnavailable",
    "StoredSession",
    "make_store",
]


def make_store(config: StoreConfig) -> SessionStore:
    if config.backend == "redis":
        # Imported here: a single router with the memory store needs no Redis client.
        from wim_service.serving.store.redis_store import RedisSessionStore

        return RedisSessionStore.from_env(config)
    return MemorySessionStore(config.tombstone_ttl_s)
