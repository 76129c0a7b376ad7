"""Stored documents' KV as the service sees it: sealed objects in the configured store.

`DocumentKV.from_env()` is what every process builds for itself (the engine core, its
workers, a router that deletes documents): the store from `WIM_KV_STORE` (a directory or a
`redis://` URL; `EngineConfig.kv_store` sets it for an engine), bounded by
`WIM_KV_STORE_MAX_GIB` and kept at most `WIM_KV_STORE_MAX_AGE_H` since last used, sealed with
keys from `WIM_KV_MASTER_KEY`. No vLLM import here: a
router can delete a document's KV without an engine.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from wim_service.engine.kv_transfer.keys import (
    MASTER_KEY_ENV,
    KVCipher,
    SealError,
    StoredDocument,
    master_key_from_env,
)
from wim_service.engine.kv_transfer.objects import Manifest, manifest_name, restorable_blocks
from wim_service.engine.kv_transfer.redis_store import RedisKVStore
from wim_service.engine.kv_transfer.store import DirectoryKVStore, KVStore, StoreError

logger = logging.getLogger(__name__)

STORE_ENV = "WIM_KV_STORE"
MAX_GIB_ENV = "WIM_KV_STORE_MAX_GIB"
DEFAULT_MAX_GIB = 8.0
# Routers delete a session's KV when it ends; this bounds what stays when no router is left
# to end it. A session in use longer than this only loses the restore (a rebuild re-reads).
MAX_AGE_ENV = "WIM_KV_STORE_MAX_AGE_H"
DEFAULT_MAX_AGE_H = 24.0


def open_store(url: str, max_bytes: int) -> KVStore:
    """The backend `url` names: Redis for a `redis://`/`rediss://` URL, else a directory."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisKVStore(url, max_bytes)
    return DirectoryKVStore(Path(url), max_bytes)


def store_url() -> str | None:
    return os.environ.get(STORE_ENV, "").strip() or None


class DocumentKV:
    def __init__(
        self, store: KVStore, cipher: KVCipher, max_age_s: float = DEFAULT_MAX_AGE_H * 3600
    ) -> None:
        self.store = store
        self.cipher = cipher
        self.max_age_s = max_age_s

    @classmethod
    def from_env(cls) -> DocumentKV | None:
        """The configured store, or None when `WIM_KV_STORE` is unset. A store without a
        master key is refused: stored KV is customer data and is never written in clear."""
        url = store_url()
        if url is None:
            return None
        key = master_key_from_env()
        if key is None:
            raise ValueError(f"{STORE_ENV} is set but {MASTER_KEY_ENV} is not")
        max_gib = float(os.environ.get(MAX_GIB_ENV) or DEFAULT_MAX_GIB)
        max_age_h = float(os.environ.get(MAX_AGE_ENV) or DEFAULT_MAX_AGE_H)
        if not max_age_h > 0:
            raise ValueError(f"{MAX_AGE_ENV} must be a positive number of hours")
        store = open_store(url, int(max_gib * 2**30))
        return cls(store, KVCipher(key), max_age_s=max_age_h * 3600)

    def put(self, doc: StoredDocument, name: str, binding: str, data: bytes) -> int:
        """Seal and store one object; the bytes written. Raises `StoreError`."""
        sealed = self.cipher.seal(doc, name, binding, data)
        self.store.put(self.cipher.storage_id(doc), name, sealed)
        return len(sealed)

    def get(self, doc: StoredDocument, name: str, binding: str) -> bytes | None:
        """One object opened; None if absent. Raises `StoreError`, `keys.SealError`."""
        sealed = self.store.get(self.cipher.storage_id(doc), name)
        return None if sealed is None else self.cipher.open(doc, name, binding, sealed)

    def read_manifest(self, doc: StoredDocument, signature: str) -> Manifest | None:
        name = manifest_name(signature)
        data = self.get(doc, name, signature)
        return None if data is None else Manifest.decode(data)

    def restorable(
        self, doc: StoredDocument, signature: str, block_size: int, token_ids: list[int]
    ) -> tuple[int, str | None]:
        """Whole blocks of `token_ids` an engine of `signature` can restore from `doc`'s
        stored KV, or 0 and the reason (the fallback reasons of docs/kv-store.md)."""
        try:
            manifest = self.read_manifest(doc, signature)
        except StoreError as exc:
            logger.warning("KV restore falls back to a re-read: %s", exc)
            return 0, exc.reason
        except (SealError, ValueError, KeyError):
            return 0, "tampered"
        except Exception:  # in the engine core, an exception would end the engine
            logger.exception("KV restore falls back to a re-read")
            return 0, "error"
        if manifest is None:
            return 0, "missing"
        if (manifest.doc, manifest.signature, manifest.block_size) != (doc, signature, block_size):
            return 0, "mismatch"
        blocks = restorable_blocks(manifest, token_ids)
        return (blocks, None) if blocks else (0, "digest")

    def write_manifest(self, manifest: Manifest) -> int:
        name = manifest_name(manifest.signature)
        return self.put(manifest.doc, name, manifest.signature, manifest.encode())

    def delete(self, doc: StoredDocument) -> bool:
        """Remove every object of `doc` (every engine signature); False, logged, if the
        store could not be reached (the caller may try again later)."""
        try:
            removed = self.store.delete_document(self.cipher.storage_id(doc))
        except StoreError as exc:
            logger.warning("stored KV of a document not deleted: %s", exc)
            return False
        logger.debug("deleted %d stored KV objects of a document", removed)
        return True

    def expire(self) -> int:
        """Delete the documents unused for `max_age_s` (a manifest read or a write uses one);
        how many, 0 and logged if the store could not be reached."""
        try:
            return self.store.expire(time.time() - self.max_age_s)
        except StoreError as exc:
            logger.warning("stored KV past its age not deleted: %s", exc)
            return 0

    def total_bytes(self) -> int | None:
        """The store's size in bytes (`wim_kv_store_bytes`); None if unreachable."""
        try:
            return self.store.total_bytes()
        except StoreError:
            return None


PARAMS_KEY = "wim_kv"


def spine_extra_args(doc: StoredDocument, open_id: str, *, restore: bool) -> dict[str, object]:
    """`SamplingParams.extra_args` of a stored document's spine: vLLM hands them to the
    connector as the request's `kv_transfer_params`. Only the engine layer sets them (the
    service never forwards a client's sampling parameters); a request without them is never
    saved or restored."""
    params = {"tenant": doc.tenant, "document": doc.document, "open": open_id, "restore": restore}
    return {"kv_transfer_params": {PARAMS_KEY: params}}
