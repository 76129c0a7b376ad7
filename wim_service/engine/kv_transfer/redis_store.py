"""The Redis backend of the KV store (`store.open_store` with a `redis://` URL).

One hash per document (`wim-kv:doc:<id>`, a field per object), so a document is deleted with
one `DEL`; a sorted set of documents by last use (`wim-kv:lru`) gives the eviction order; a
hash of sizes per document and one total (`wim-kv:sizes`, `wim-kv:bytes`) keep the bound
without scanning. Each change runs as one Lua script, atomic against other engines and
routers sharing the server. Short socket timeouts: a server that does not answer is a miss
in a second or two, not a stalled engine step.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from wim_service.engine.kv_transfer.store import MANIFEST, StoreFull, StoreUnavailable

PREFIX = "wim-kv:"
_TIMEOUT_S = 2.0

# KEYS: document hash, sizes, lru, total. ARGV: field, value, doc id, now.
_PUT = """
local old = redis.call('HSTRLEN', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local delta = string.len(ARGV[2]) - old
redis.call('HINCRBY', KEYS[2], ARGV[3], delta)
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
return redis.call('INCRBY', KEYS[4], delta)
"""
# KEYS: document hash, sizes, lru, total. ARGV: doc id. Returns the objects removed.
_DELETE = """
local count = redis.call('HLEN', KEYS[1])
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], size)
return count
"""


class RedisKVStore:
    def __init__(self, url: str, max_bytes: int, prefix: str = PREFIX) -> None:
        self.max_bytes = max_bytes
        self.prefix = prefix
        self._redis = redis.Redis.from_url(
            url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S
        )
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)

    def _keys(self, doc_id: str) -> list[str]:
        p = self.prefix
        return [p + "doc:" + doc_id, p + "sizes", p + "lru", p + "bytes"]

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            if "OOM" in str(exc):  # the server's own maxmemory refused the write
                raise StoreFull(f"KV store (Redis) {what}: {exc}") from exc
            raise StoreUnavailable(f"KV store (Redis) {what}: {exc}") from exc

    def put(self, doc_id: str, name: str, data: bytes) -> None:
        if self.total_bytes() + len(data) > self.max_bytes:
            self._make_room(doc_id, len(data))
        self._call(
            "write", self._put, keys=self._keys(doc_id), args=[name, data, doc_id, time.time()]
        )

    def _make_room(self, keep: str, size: int) -> None:
        for doc_id in self.documents():
            if self.total_bytes() + size <= self.max_bytes:
                return
            if doc_id != keep:
                self.delete_document(doc_id)
        if self.total_bytes() + size > self.max_bytes:
            raise StoreFull(f"KV store (Redis) is full ({self.total_bytes()} bytes)")

    def get(self, doc_id: str, name: str) -> bytes | None:
        value = self._call("read", self._redis.hget, self.prefix + "doc:" + doc_id, name)
        if value is not None and name.startswith(MANIFEST):
            self._call(
                "touch", self._redis.zadd, self.prefix + "lru", {doc_id: time.time()}, xx=True
            )
        return value

    def delete_document(self, doc_id: str) -> int:
        return int(self._call("delete", self._delete, keys=self._keys(doc_id), args=[doc_id]))

    def total_bytes(self) -> int:
        return int(self._call("size", self._redis.get, self.prefix + "bytes") or 0)

    def documents(self) -> list[str]:
        listed = self._call("list", self._redis.zrange, self.prefix + "lru", 0, -1)
        return [raw.decode() for raw in listed]

    def expire(self, before: float) -> int:
        lru = self.prefix + "lru"
        listed = self._call("list", self._redis.zrangebyscore, lru, "-inf", f"({before}")
        for raw in listed:
            self.delete_document(raw.decode())
        return len(listed)
