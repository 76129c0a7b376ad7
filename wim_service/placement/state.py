"""What placement reads: a job's shape and every replica's state, and what it answers."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Inserts into every prefix cache of the process, counted in one sequence, so that which of two
# replicas' blocks was used longer ago can be told (`PrefixCache.eviction`).
_TOUCHES = itertools.count(1)


class PrefixCache:
    """The prefix blocks a replica is believed to hold, least recently used first.

    Blocks are hashes of fixed-size token blocks chained from the start of a prompt (the
    Mooncake traces' `hash_ids`, or the router's hashes of a prompt's blocks), so a prompt's
    cached part is the longest run of its leading blocks present here. The simulator keeps
    one per engine exactly; the live router keeps one per replica of what it sent there, an
    estimate as SGLang's cache-aware router keeps.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        # Each block with the touch (`_TOUCHES`) that last used it, least recent first.
        self._blocks: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, prefix: Sequence[int]) -> int:
        """How many leading blocks of `prefix` are cached."""
        held = 0
        for block in prefix:
            if block not in self._blocks:
                break
            held += 1
        return held

    def insert(self, prefix: Sequence[int]) -> None:
        """Record `prefix` as cached and most recently used; evict the least recently used
        blocks past capacity. Its blocks are touched tail first, so that its leading blocks
        outlive its tail, as in vLLM, which frees a request's blocks in reverse order
        (`vllm/v1/core/kv_cache_manager.py`): a tail without its head is no prefix."""
        touch = next(_TOUCHES)
        for block in reversed(prefix):
            self._blocks[block] = touch
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def eviction(self, prefix: Sequence[int]) -> tuple[bool, int]:
        """What caching `prefix` here would evict, to rank replicas that are otherwise alike:
        whether it evicts other prompts' blocks, then the touch that last used the first of
        them it would evict (lower: used longer ago, in any cache of the process). Sent where
        the block used longest ago goes, work makes the fleet's caches evict as one LRU cache
        of all their blocks would. Placed by replica name instead, it churned a few replicas'
        caches while others stood empty: on Mooncake's synthetic trace with 400,000 KV tokens
        per replica at 32 replicas `wim sim` gave a p95 TTFT 0.77x sticky's, against 0.48x so
        (docs/routing.md)."""
        held = self.match(prefix)
        if len(self._blocks) + len(prefix) - held <= self.capacity_blocks:
            return (False, 0)
        # What a cache holds of a prompt is a run of its leading blocks (`insert`): the blocks
        # it keeps are its first `held`.
        kept = set(prefix[:held])
        oldest = next((t for b, t in self._blocks.items() if b not in kept), None)
        return (False, 0) if oldest is None else (True, oldest)


@dataclass(frozen=True)
class Work:
    """One job as placement sees it, in tokens.

    A *document* job (`document` set) runs on a replica holding that document's KV (a copy):
    a query of a document session, or the session's first read. Any other job (a one-shot WiM
    job, a plain request, a trace request) prefills its `prompt_tokens`, of which the leading
    `prefix` blocks may already be cached on a replica.
    """

    prompt_tokens: int  # tokens prefilled when nothing is cached (document + query)
    answer_tokens: int  # tokens decoded for the answer
    kv_blocks: int = 0  # worst-case KV reservation of the job itself
    prefix: tuple[int, ...] = ()  # hashes of the prompt's leading blocks
    prefix_block_tokens: int = 512
    document: str | None = None
    document_tokens: int = 0  # what a copy of the document costs to prefill
    document_blocks: int = 0  # what a copy of the document holds in KV
    # The document was read before (a query's, or a session's rebuild): with a KV store its
    # KV was saved then, so a copy restores it (`EngineProfile.read_seconds`). A new
    # session's first read has nothing saved.
    restorable: bool = False
    margins: int = 0  # margins the job writes (one per segment it reads)
    margin_tokens: int = 0  # tokens decoded per margin
    # Whether the job takes one of the replica's session slots while it runs: a WiM job
    # opens a context (the engine's `max_sessions` admission); a plain request reserves KV
    # only, so a replica whose slots are all held still takes it.
    takes_session: bool = True

    def cached_tokens(self, blocks: int) -> int:
        return min(self.prompt_tokens, blocks * self.prefix_block_tokens)

    @property
    def reads_only(self) -> bool:
        """A document's read without a query (a new session's first read)."""
        return self.document is not None and self.answer_tokens == 0


@dataclass
class ReplicaState:
    """A replica's state at the moment of placement."""

    replica: str
    free_blocks: int
    free_sessions: int
    # Expected seconds before a job sent now starts its prefill: the admitted work ahead of it.
    backlog_s: float = 0.0
    running: int = 0  # sequences decoding now (the batch a new job joins)
    draining: bool = False
    documents: frozenset[str] = frozenset()  # documents with a copy here
    prefix_cache: PrefixCache | None = None

    def cached_blocks(self, work: Work) -> int:
        return self.prefix_cache.match(work.prefix) if self.prefix_cache is not None else 0

    def cached_tokens(self, work: Work) -> int:
        """The job's prompt tokens this replica is believed to serve from its cache."""
        return work.cached_tokens(self.cached_blocks(work))

    def eviction(self, work: Work) -> tuple[bool, int]:
        """What caching the job's prompt here would evict (`PrefixCache.eviction`)."""
        return (
            self.prefix_cache.eviction(work.prefix) if self.prefix_cache is not None else (False, 0)
        )


@dataclass(frozen=True)
class Placement:
    replica: str
    # The job reads a copy of its document on `replica` first (the document's first copy for a
    # new session; another one for a hot document).
    open_copy: bool = False
    cached_tokens: int = 0  # prompt tokens `replica` is expected to serve from its cache
    expected_wait_s: float = 0.0  # the policy's estimate until the job's first token


class NoRoom(Exception):
    """No replica can take the job now (every one full or draining)."""

    def __init__(self, work: Work, replicas: int) -> None:
        # A new copy of a document needs the document's blocks as well as the job's.
        needed = work.kv_blocks + work.document_blocks
        super().__init__(f"no engine replica has room for {needed} KV blocks ({replicas} live)")
        self.replicas = replicas
