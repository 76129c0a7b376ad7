"""A vLLM scheduler that can purge one WiM session's KV from the prefix cache.

vLLM frees a finished request's blocks but keeps their hashes, so a later request with the same
cache salt would still hit the document's KV: user data outlives the session. This subclass
remembers, per WiM salt, which blocks were hashed under it; `wim_purge_salt` drops those hash
entries and moves the blocks to the head of the free queue, so they are overwritten first.

It runs inside the engine-core process (vLLM loads it by name from `scheduler_cls`); importing
this module also registers two utility methods on `EngineCore`, callable from the front end
with `engine_core.call_utility_async(name, ...)`. These use private vLLM members; the vLLM
version is pinned and `tests/test_vllm_engine.py` exercises every one of them.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request

SALT_PREFIX = "wim:"
# Peak KV use is remembered for this many recent salts (tests compare it with reservations).
_PEAKS_KEPT = 4096


class WiMScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # salt -> {block id -> block hash it held under that salt}
        self._salt_blocks: dict[str, dict[int, Any]] = defaultdict(dict)
        # salt -> most distinct KV blocks its requests held at once (after any step)
        self._salt_peaks: OrderedDict[str, int] = OrderedDict()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        self._track_peaks()
        return output

    def _track_peaks(self) -> None:
        """Blocks held per WiM salt now (a block shared by a context and its branches counts
        once): what a job's KV reservation must cover."""
        held: dict[str, set[int]] = {}
        for request in self.requests.values():
            salt = request.cache_salt
            if not salt or not salt.startswith(SALT_PREFIX):
                continue
            ids = held.setdefault(salt, set())
            for group in self.kv_cache_manager.get_blocks(request.request_id).blocks:
                ids.update(block.block_id for block in group if not block.is_null)
        for salt, ids in held.items():
            if len(ids) > self._salt_peaks.get(salt, 0):
                self._salt_peaks[salt] = len(ids)
                self._salt_peaks.move_to_end(salt)
        while len(self._salt_peaks) > _PEAKS_KEPT:
            self._salt_peaks.popitem(last=False)

    def wim_peak_blocks(self, salt: str) -> int:
        return self._salt_peaks.get(salt, 0)

    def _record(self, request: Request) -> None:
        salt = request.cache_salt
        if not salt or not salt.startswith(SALT_PREFIX):
            return
        recorded = self._salt_blocks[salt]
        for group in self.kv_cache_manager.get_blocks(request.request_id).blocks:
            for block in group:
                if block.block_hash is not None:
                    recorded[block.block_id] = block.block_hash

    def _free_request_blocks(self, request: Request) -> None:
        # Every path that returns a request's blocks (finish, abort, preemption) passes here
        # while the blocks still carry their hashes.
        self._record(request)
        super()._free_request_blocks(request)

    def wim_purge_salt(self, salt: str) -> dict[str, int]:
        """Forget the cache entries of `salt`. Blocks still referenced are reported busy."""
        pool = self.kv_cache_manager.block_pool
        recorded = self._salt_blocks.get(salt, {})
        purged = busy = stale = 0
        to_front = []
        for block_id, block_hash in list(recorded.items()):
            block = pool.blocks[block_id]
            if block.block_hash != block_hash:
                stale += 1  # already evicted and reused for something else
            elif block.ref_cnt > 0:
                busy += 1
                continue
            else:
                pool._maybe_evict_cached_block(block)
                pool.free_block_queue.remove(block)
                to_front.append(block)
                purged += 1
            del recorded[block_id]
        pool.free_block_queue.prepend_n(to_front)
        if not recorded:
            self._salt_blocks.pop(salt, None)
        return {"purged": purged, "busy": busy, "stale": stale}

    def wim_kv_stats(self) -> dict[str, int]:
        pool = self.kv_cache_manager.block_pool
        return {
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1,  # block 0 is vLLM's null block
            "cached_blocks": len(pool.cached_block_hash_to_block),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "parked_sessions": self.num_waiting_for_streaming_input,
        }


def _engine_wim_purge_salt(self: EngineCore, salt: str) -> dict[str, int]:
    return self.scheduler.wim_purge_salt(salt)


def _engine_wim_kv_stats(self: EngineCore) -> dict[str, int]:
    return self.scheduler.wim_kv_stats()


def _engine_wim_peak_blocks(self: EngineCore, salt: str) -> int:
    return self.scheduler.wim_peak_blocks(salt)


EngineCore.wim_purge_salt = _engine_wim_purge_salt  # type: ignore[attr-defined]
EngineCore.wim_kv_stats = _engine_wim_kv_stats  # type: ignore[attr-defined]
EngineCore.wim_peak_blocks = _engine_wim_peak_blocks  # type: ignore[attr-defined]
