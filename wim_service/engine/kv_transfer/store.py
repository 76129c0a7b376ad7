"""Where stored document KV lives: a directory (one machine, or a shared volume) or Redis.

`documents.open_store(url, max_bytes)` picks the backend from one setting (`WIM_KV_STORE` /
`EngineConfig.kv_store`): a `redis://` or `rediss://` URL, else a directory path. Objects are
opaque sealed bytes (`keys.KVCipher`) grouped by document: `put`/`get` one object,
`delete_document` removes everything of one document. Both backends are bounded: a `put`
that would pass `max_bytes` first evicts whole documents, least recently used first (a
document is used when it is written or its manifest is read), never the one being written;
if that one alone does not fit, the put fails with `StoreFull`. `expire(before)` deletes the
documents last used before a wall-clock time: the retention bound for KV whose session no
router ended (every router gone at once). A store that cannot be reached
raises `StoreUnavailable`. Callers turn both into a miss or a stopped save (`connector`),
never an error of a request.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Protocol

MANIFEST = "manifest"


class StoreError(Exception):
    """The store could not do what was asked (`reason` names it for metrics)."""

    reason = "store_error"


class StoreUnavailable(StoreError):
    reason = "store_down"


class StoreFull(StoreError):
    reason = "store_full"


class KVStore(Protocol):
    def put(self, doc_id: str, name: str, data: bytes) -> None: ...

    def get(self, doc_id: str, name: str) -> bytes | None: ...

    def delete_document(self, doc_id: str) -> int: ...

    def total_bytes(self) -> int: ...

    def documents(self) -> list[str]: ...

    def expire(self, before: float) -> int: ...


class DirectoryKVStore:
    """`root/<document>/<object>` files, written to a temporary name and renamed into place
    (a reader never sees half an object). Several engines may share the directory; each
    counts the total itself and recounts it before evicting, so the bound holds to within
    what the others wrote since."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"KV store directory {root}: {exc}") from exc
        self._total = self._count()

    def _doc(self, doc_id: str) -> Path:
        return self.root / doc_id

    def _count(self) -> int:
        total = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(directory, name)).st_size
        return total

    def put(self, doc_id: str, name: str, data: bytes) -> None:
        path = self._doc(doc_id) / name
        try:
            if self._total + len(data) > self.max_bytes:
                self._make_room(doc_id, len(data))
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temporary.write_bytes(data)
            old = path.stat().st_size if path.exists() else 0
            os.replace(temporary, path)
            os.utime(self._doc(doc_id))
        except OSError as exc:
            raise StoreUnavailable(f"KV store write {path}: {exc}") from exc
        self._total += len(data) - old

    def _make_room(self, keep: str, size: int) -> None:
        self._total = self._count()
        by_age = sorted(self.documents(), key=self._last_used)
        for doc_id in by_age:
            if self._total + size <= self.max_bytes:
                return
            if doc_id != keep:
                self.delete_document(doc_id)
        if self._total + size > self.max_bytes:
            raise StoreFull(f"KV store {self.root} is full ({self._total} bytes)")

    def _last_used(self, doc_id: str) -> float:
        try:
            return self._doc(doc_id).stat().st_mtime
        except OSError:
            return 0.0

    def get(self, doc_id: str, name: str) -> bytes | None:
        path = self._doc(doc_id) / name
        try:
            data = path.read_bytes()
            if name.startswith(MANIFEST):
                os.utime(self._doc(doc_id))
            return data
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"KV store read {path}: {exc}") from exc

    def delete_document(self, doc_id: str) -> int:
        directory = self._doc(doc_id)
        if not directory.exists():
            return 0
        files = [p for p in directory.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        # Renamed first: a writer racing the delete recreates an empty directory, not a
        # half-deleted document.
        doomed = directory.with_name(f".deleted.{doc_id}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.replace(directory, doomed)
            shutil.rmtree(doomed)
        except OSError as exc:
            raise StoreUnavailable(f"KV store delete {directory}: {exc}") from exc
        self._total = max(0, self._total - size)
        return len(files)

    def total_bytes(self) -> int:
        self._total = self._count()
        return self._total

    def documents(self) -> list[str]:
        try:
            return [p.name for p in self.root.iterdir() if p.is_dir() and p.name[0] != "."]
        except OSError as exc:
            raise StoreUnavailable(f"KV store {self.root}: {exc}") from exc

    def expire(self, before: float) -> int:
        doomed = [d for d in self.documents() if 0 < self._last_used(d) < before]
        for doc_id in doomed:
            self.delete_document(doc_id)
        return len(doomed)
