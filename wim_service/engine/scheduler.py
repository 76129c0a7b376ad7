"""A vLLM scheduler that can purge one WiM session's KV from the prefix cache.

vLLM frees a finished request's blocks but keeps their hashes, so a later request with the same
cache salt would still hit the document's KV: user data outlives the session. This subclass
remembers, per WiM salt, which blocks its requests held; `wim_purge_salt` drops those blocks'
hash entries and moves them to the head of the free queue, so they are overwritten first. The
salt is then *closed*: blocks still busy at that moment (a branch finishing its abort), and
any block a request of that salt frees later, are purged as they are freed. With `zero`, purged
blocks' KV memory is also overwritten with zeros in every worker (`engine/kv_memory.py`), before
the scheduler can hand them to another request.

It runs inside the engine-core process (vLLM loads it by name from `scheduler_cls`); importing
this module also registers utility methods (`wim_*`) on `EngineCore`, callable from the front end
with `engine_core.call_utility_async(name, ...)`. These use private vLLM members; the vLLM
version is pinned and `tests/engine/test_vllm_engine.py` and `tests/wim/test_jobs_give_back.py`
exercise every one of them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request

from wim_service.engine.kv_memory import ZERO_BLOCKS
from wim_service.engine.lifetime import die_with_multiprocessing_parent

logger = logging.getLogger(__name__)

SALT_PREFIX = "wim:"
# Peak KV use is remembered for this many recent salts (tests compare it with reservations).
_PEAKS_KEPT = 4096
# Closed salts are remembered this long (in salts): a request of one still in flight when its
# context closed is purged when it frees its blocks.
_CLOSED_KEPT = 4096


class WiMScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The first code of ours in the engine-core process: from here on it ends with the
        # front end that started it, even one killed before it could shut the engine down.
        die_with_multiprocessing_parent()
        super().__init__(*args, **kwargs)
        # salt -> {block id -> block hash it held under that salt (None: never hashed)}
        self._salt_blocks: dict[str, dict[int, Any]] = defaultdict(dict)
        # Purged salts -> whether their blocks are zeroed; oldest first.
        self._closed: OrderedDict[str, bool] = OrderedDict()
        # Zeroes blocks' KV memory in every worker (set by the engine core; see below).
        self._zero_blocks: Callable[[list[int]], Any] | None = None
        # salt -> most distinct KV blocks its requests held at once (after any step)
        self._salt_peaks: OrderedDict[str, int] = OrderedDict()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        self._track_peaks()
        return output

    def _blocks_of(self, request: Request) -> list[Any]:
        return [
            block
            for group in self.kv_cache_manager.get_blocks(request.request_id).blocks
            for block in group
            if not block.is_null
        ]

    def _track_peaks(self) -> None:
        """Blocks held per WiM salt now (a block shared by a context and its branches counts
        once): what a job's KV reservation must cover."""
        held: dict[str, set[int]] = {}
        for request in self.requests.values():
            salt = request.cache_salt
            if not salt or not salt.startswith(SALT_PREFIX):
                continue
            held.setdefault(salt, set()).update(b.block_id for b in self._blocks_of(request))
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
        for block in self._blocks_of(request):
            # Unhashed blocks (a partial last block, a branch's own tokens) hold user data too.
            recorded[block.block_id] = block.block_hash

    def _free_request_blocks(self, request: Request) -> None:
        # Every path that returns a request's blocks (finish, abort, preemption) passes here
        # while the blocks still carry their hashes.
        self._record(request)
        super()._free_request_blocks(request)
        salt = request.cache_salt
        if salt is not None and salt in self._closed:
            self._purge(salt)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        # Blocks returned outside `_free_request_blocks` (vLLM's deferred frees) are caught
        # here: every closed salt with blocks left is purged again after each step.
        for salt in [s for s in self._salt_blocks if s in self._closed]:
            self._purge(salt)
        return outputs

    def wim_purge_salt(self, salt: str, zero: bool = False) -> dict[str, int]:
        """Forget the cache entries of `salt` and close it (its later frees are purged too).

        Blocks still referenced are reported busy; they are purged when they are freed.
        `zero` also zeroes the purged blocks' KV memory (needs `bind_zeroing`).
        """
        self._closed[salt] = zero
        self._closed.move_to_end(salt)
        while len(self._closed) > _CLOSED_KEPT:
            self._closed.popitem(last=False)
        return self._purge(salt)

    def bind_zeroing(self, zero_blocks: Callable[[list[int]], Any]) -> None:
        self._zero_blocks = zero_blocks

    def _purge(self, salt: str) -> dict[str, int]:
        pool = self.kv_cache_manager.block_pool
        recorded = self._salt_blocks.get(salt, {})
        # Blocks the salt's live requests hold: recorded (and purged) when they are freed.
        busy = self._live_blocks(salt)
        purged = stale = 0
        to_front = []
        for block_id, block_hash in list(recorded.items()):
            block = pool.blocks[block_id]
            if block_id in busy:
                continue
            if block.block_hash != block_hash:
                stale += 1  # already evicted and reused for something else
            elif block.ref_cnt > 0 and block_hash is not None:
                # Only this salt can hit it: its request is gone but the block not yet free
                # (vLLM defers some frees); purged after a later step.
                busy.add(block_id)
                continue
            elif block.ref_cnt > 0:
                # An unhashed block in use: reused by another request, or still held by one
                # of this salt's, which records it again when it frees it.
                stale += 1
            else:
                if block_hash is not None:
                    pool._maybe_evict_cached_block(block)
                pool.free_block_queue.remove(block)
                to_front.append(block)
                purged += 1
            del recorded[block_id]
        if to_front and self._closed.get(salt) and self._zero_blocks is not None:
            # Synchronous, before the blocks can be allocated again. This may run inside an
            # engine step, where an exception would kill the engine: a failure is logged.
            try:
                self._zero_blocks([block.block_id for block in to_front])
            except Exception:
                logger.exception("zeroing %d purged KV blocks failed", len(to_front))
        pool.free_block_queue.prepend_n(to_front)
        if not recorded:
            self._salt_blocks.pop(salt, None)
        return {"purged": purged, "busy": len(busy), "stale": stale}

    def _live_blocks(self, salt: str) -> set[int]:
        return {
            block.block_id
            for request in self.requests.values()
            if request.cache_salt == salt
            for block in self._blocks_of(request)
        }

    def wim_salt_blocks(self, salt: str) -> list[int]:
        """Blocks the live requests of `salt` hold, and blocks recorded for it (tests)."""
        return sorted(self._live_blocks(salt) | set(self._salt_blocks.get(salt, {})))

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


def _scheduler(core: EngineCore) -> WiMScheduler:
    """The engine core's scheduler: ours, as `scheduler_cls` names it."""
    scheduler = core.scheduler
    assert isinstance(scheduler, WiMScheduler)
    return scheduler


def _engine_wim_purge_salt(self: EngineCore, salt: str, zero: bool = False) -> dict[str, int]:
    if zero:
        # The scheduler zeroes through the workers, which only the engine core can reach.
        _scheduler(self).bind_zeroing(lambda ids: self.collective_rpc(ZERO_BLOCKS, args=(ids,)))
    return _scheduler(self).wim_purge_salt(salt, zero)


def _engine_wim_kv_stats(self: EngineCore) -> dict[str, int]:
    return _scheduler(self).wim_kv_stats()


def _engine_wim_peak_blocks(self: EngineCore, salt: str) -> int:
    return _scheduler(self).wim_peak_blocks(salt)


def _engine_wim_salt_blocks(self: EngineCore, salt: str) -> list[int]:
    return _scheduler(self).wim_salt_blocks(salt)


EngineCore.wim_purge_salt = _engine_wim_purge_salt
EngineCore.wim_kv_stats = _engine_wim_kv_stats
EngineCore.wim_peak_blocks = _engine_wim_peak_blocks
EngineCore.wim_salt_blocks = _engine_wim_salt_blocks
