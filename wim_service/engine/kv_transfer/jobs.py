"""What the connector's scheduler side tells its workers each step, and what they report back.

The scheduler side plans (`LoadJob`: blocks of a restoring spine to fill before this step's
forward; `SaveJob`: a spine's blocks this step fills) in the engine core; each worker runs them
on its KV tensors and returns one `OpenResult` per context (keyed by the context's open id, its
cache salt), summed over workers by `WorkerResults.aggregate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from wim_service.engine.kv_transfer.keys import StoredDocument


@dataclass
class LoadJob:
    open_id: str
    doc: StoredDocument
    signature: str
    first_index: int
    block_ids: list[int]
    chain: list[bytes]  # links of blocks first_index .. first_index + len(block_ids) - 1


@dataclass
class SaveJob:
    open_id: str
    doc: StoredDocument
    signature: str
    first_index: int
    block_ids: list[int]
    chain: list[bytes]  # links of every block 0 .. first_index + len(block_ids) - 1


@dataclass
class StepJobs(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class OpenResult:
    """One context's outcome in one step (summed over workers)."""

    loaded_blocks: int = 0
    load_failed: str | None = None
    load_seconds: float = 0.0
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_failed: str | None = None

    def merge(self, other: OpenResult) -> OpenResult:
        return OpenResult(
            # Every worker loads its share of the same blocks: a block is loaded if all did.
            loaded_blocks=min(self.loaded_blocks, other.loaded_blocks),
            load_failed=self.load_failed or other.load_failed,
            load_seconds=max(self.load_seconds, other.load_seconds),
            saved_blocks=min(self.saved_blocks, other.saved_blocks),
            saved_bytes=self.saved_bytes + other.saved_bytes,
            save_failed=self.save_failed or other.save_failed,
        )


@dataclass
class WorkerResults(KVConnectorWorkerMetadata):
    results: dict[str, OpenResult] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerResults)
        merged = dict(self.results)
        for open_id, result in other.results.items():
            mine = merged.get(open_id)
            merged[open_id] = result if mine is None else mine.merge(result)
        return WorkerResults(merged)
