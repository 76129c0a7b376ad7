"""The router's part in stored document KV (`engine/kv_transfer`, docs/kv-store.md).

Engine replicas save a document's KV as they read it and restore it on a rebuild or a copy;
what outlives every replica is the router's to end: a session that ends (DELETE, TTL expiry)
or a new document whose read failed has its stored KV deleted here, so that nothing of a
document stays in the store once the service forgot it. What no router is left to end is
deleted once unused for `WIM_KV_STORE_MAX_AGE_H` (any router sweeps it, as it measures the
store for `wim_kv_store_bytes`). Without a store (`WIM_KV_STORE` unset) every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging

from wim_service.engine.kv_transfer.documents import DocumentKV
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.wim.backend import StoredDocument

logger = logging.getLogger(__name__)


class StoredKV:
    def __init__(self, metrics: WiMMetrics, store: DocumentKV | None) -> None:
        self.metrics = metrics
        self.store = store

    @classmethod
    def from_env(cls, metrics: WiMMetrics) -> StoredKV:
        """The store the engine replicas share (the same environment reaches every
        deployment of the application); a store named without a master key is refused
        here, at the router's start."""
        return cls(metrics, DocumentKV.from_env())

    async def delete(self, tenant: str, document_id: str) -> None:
        """Remove a document's stored KV (a store that cannot be reached logs it; the
        document's objects then run out by the store's eviction)."""
        if self.store is not None:
            await asyncio.to_thread(self.store.delete, StoredDocument(tenant, document_id))

    async def maintain(self) -> None:
        """Delete what is past the store's age, then set `wim_kv_store_bytes` (left as it
        was while the store cannot be reached)."""
        if self.store is None:
            return
        expired = await asyncio.to_thread(self.store.expire)
        if expired:
            logger.info("deleted the stored KV of %d documents unused past its age", expired)
        size = await asyncio.to_thread(self.store.total_bytes)
        if size is not None:
            self.metrics.kv_store_bytes.set(size)
