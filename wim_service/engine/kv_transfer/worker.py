"""The connector's worker side: runs the step's `LoadJob`s and `SaveJob`s on the KV tensors.

Loads run before the step's forward (the scheduler marks the step as having synchronous
loads), saves after it (`wait_for_save`), both synchronously: a saved block is written before
the step's output reaches the front end, and a restored one before any token reads it.

Each block is sealed with its binding: the engine signature, this worker's tensor layout and
the block's token-chain link, so a block opens only on an engine that lays KV out the same way
and only for the same tokens. A load that cannot fetch or open every one of its blocks reports
all of them failed (`load_errors`), and vLLM recomputes the spine from its first token
(`kv_load_failure_policy="recompute"`): no request ever runs on part of a document's KV.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from wim_service.engine.kv_transfer.block_io import BlockIO
from wim_service.engine.kv_transfer.documents import DocumentKV
from wim_service.engine.kv_transfer.jobs import LoadJob, OpenResult, SaveJob
from wim_service.engine.kv_transfer.keys import SealError
from wim_service.engine.kv_transfer.objects import Manifest, block_name
from wim_service.engine.kv_transfer.store import StoreError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

LOAD_BATCH_BLOCKS = 16


class _BlockMissing(Exception):
    pass


class WorkerSide:
    def __init__(self, kv: DocumentKV | None, block_size: int) -> None:
        self.kv = kv
        self.block_size = block_size
        self.io: BlockIO | None = None
        self.rank = 0
        self._layout = ""
        self.results: dict[str, OpenResult] = {}
        self._load_errors: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int) -> None:
        self.rank = rank
        try:
            self.io = BlockIO(kv_caches, num_blocks)
        except RuntimeError:
            # KV tensors laid out in a way not understood: every load fails (and is
            # recomputed), nothing is saved; the engine itself runs on.
            logger.exception("stored document KV is off on this worker")
            return
        self._layout = self.io.layout()

    def _binding(self, signature: str, link: bytes) -> str:
        return f"{signature}|{self._layout}|{link.hex()}"

    def _result(self, open_id: str) -> OpenResult:
        return self.results.setdefault(open_id, OpenResult())

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def load(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            started = time.perf_counter()
            result = self._result(job.open_id)
            try:
                self._load(job)
            # Anything at all: an exception here would end the engine, not just the load.
            except Exception as exc:
                reason = getattr(exc, "reason", "block_check")
                expected = isinstance(exc, StoreError | SealError | _BlockMissing | ValueError)
                logger.warning("KV restore failed (%s): %r", reason, exc, exc_info=not expected)
                result.load_failed = reason
                self._load_errors.update(job.block_ids)
                continue
            result.loaded_blocks += len(job.block_ids)
            result.load_seconds += time.perf_counter() - started

    def _load(self, job: LoadJob) -> None:
        if self.kv is None or self.io is None:
            raise _BlockMissing("this worker keeps no stored KV")
        # A few blocks at a time: a long document's KV is never all in memory twice.
        for start in range(0, len(job.block_ids), LOAD_BATCH_BLOCKS):
            payloads = []
            for offset in range(start, min(start + LOAD_BATCH_BLOCKS, len(job.block_ids))):
                name = block_name(job.signature, self.rank, job.first_index + offset)
                binding = self._binding(job.signature, job.chain[offset])
                data = self.kv.get(job.doc, name, binding)
                if data is None:
                    raise _BlockMissing(f"stored block {name} is missing")
                payloads.append(data)
            self.io.write(job.block_ids[start : start + len(payloads)], payloads)

    def save(self, jobs: list[SaveJob]) -> None:
        for job in jobs:
            result = self._result(job.open_id)
            if result.load_failed:
                # This step's tokens attended to blocks that did not load: vLLM recomputes
                # them, and the recompute saves them.
                continue
            try:
                result.saved_bytes += self._save(job)
            except Exception as exc:  # never an engine failure: the document is still read
                result.save_failed = getattr(exc, "reason", "error")
                expected = isinstance(exc, StoreError)
                logger.warning(
                    "KV save of a document stopped (%s): %r",
                    result.save_failed,
                    exc,
                    exc_info=not expected,
                )
                continue
            result.saved_blocks += len(job.block_ids)

    def _save(self, job: SaveJob) -> int:
        if self.kv is None or self.io is None:
            raise _BlockMissing("this worker keeps no stored KV")
        written = 0
        payloads = self.io.read(job.block_ids)
        links = job.chain[job.first_index :]
        for offset, (payload, link) in enumerate(zip(payloads, links, strict=True)):
            name = block_name(job.signature, self.rank, job.first_index + offset)
            written += self.kv.put(job.doc, name, self._binding(job.signature, link), payload)
        if self.rank == 0:
            # After the blocks: a manifest never names a block that is not written yet.
            manifest = Manifest(job.doc, job.signature, self.block_size, job.chain)
            written += self.kv.write_manifest(manifest)
        return written
