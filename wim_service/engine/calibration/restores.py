"""Restore samples for calibration and `wim bench`: what restoring a document's saved KV costs
on this engine (`EngineProfile.restore`, docs/kv-store.md).

A document of random token ids is read into a stored context (saved as it is read, 1,024
tokens a push, as a replica reads one), then restored into a fresh context, whose other
cache salt serves nothing from the prefix cache; the restore is timed from the manifest's
check to its last computed token (`KVRestore.seconds`). The store is a temporary directory
sealed with a random key (`temporary_kv_store`): its files are in the page cache, as a
document another engine saved moments before is. A restore that falls back is an error:
the sample would time a re-read.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import STORE_ENV
from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV
from wim_service.engine.process_env import environ_kept
from wim_service.placement.profile import RestoreSample
from wim_service.wim.backend import KVRestore, StoredDocument

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend

# Tokens of one push of the read, as `WiMOptions.segment_tokens` reads a document.
READ_PUSH_TOKENS = 1024
# The tenant the samples are saved under (a temporary store only this run uses).
_TENANT = "calibration"
# Documents (tokens) a calibration reads and restores, each three times (their median is
# fitted); a quick one fewer, once.
RESTORE_TOKENS = (1024, 2048, 4096)
QUICK_RESTORE_TOKENS = (256, 1024)


@contextlib.contextmanager
def temporary_kv_store(config: EngineConfig) -> Iterator[EngineConfig]:
    """`config` with a KV store of its own: a temporary directory sealed with a random master
    key, both removed afterwards, and the environment the engine start sets put back (a
    store or key already configured is never written to: it may hold customer KV)."""
    with (
        environ_kept(STORE_ENV, MASTER_KEY_ENV),
        tempfile.TemporaryDirectory(prefix="wim-kv-calibration-") as store,
    ):
        os.environ[MASTER_KEY_ENV] = base64.b64encode(secrets.token_bytes(32)).decode()
        yield config.model_copy(update={"kv_store": store})


async def read_document(
    backend: VLLMBackend, token_ids: list[int], stored: StoredDocument | None
) -> float:
    """Seconds to read `token_ids` into a new context, saved under `stored` if given."""
    context = await backend.open_context(
        reserve_blocks=_blocks(backend, len(token_ids)), stored=stored
    )
    try:
        started = time.perf_counter()
        for start in range(0, len(token_ids), READ_PUSH_TOKENS):
            await context.extend(token_ids[start : start + READ_PUSH_TOKENS])
        return time.perf_counter() - started
    finally:
        await context.close()


async def restore_document(
    backend: VLLMBackend, token_ids: list[int], stored: StoredDocument
) -> KVRestore:
    """Restore a saved document into a new context (closed again); a fallback is an error."""
    context = await backend.open_context(
        reserve_blocks=_blocks(backend, len(token_ids)), stored=stored
    )
    try:
        restore = await context.restore(token_ids)
    finally:
        await context.close()
    if restore.fallback is not None or not restore.restored_tokens:
        raise RuntimeError(f"a restore of {len(token_ids)} tokens fell back: {restore.fallback}")
    return restore


async def _restored(backend: VLLMBackend, token_ids: list[int], name: str) -> KVRestore:
    """A document read into the store, restored, then deleted from the store."""
    doc = StoredDocument(_TENANT, name)
    await read_document(backend, token_ids, doc)
    restore = await restore_document(backend, token_ids, doc)
    await backend.delete_stored(doc)
    return restore


def _blocks(backend: VLLMBackend, tokens: int) -> int:
    # +1: a push samples one token after its last.
    return math.ceil((tokens + 1) / backend.limits.block_size)


async def measure_restores(
    backend: VLLMBackend, tokens: Callable[[int], list[int]], *, quick: bool = False
) -> list[RestoreSample]:
    """Restore samples of documents of `tokens(n)` (sizes past the engine's window left out);
    none on an engine without a KV store. Each document is deleted after its sample."""
    if backend.kv_store is None:  # `calibrate_async` gives its engine a temporary one
        return []
    sizes, repeats = (QUICK_RESTORE_TOKENS, 1) if quick else (RESTORE_TOKENS, 3)
    # Warm-up, not recorded: an engine's first restore also asks the engine core for its
    # signature and runs the save and load paths for the first time (several times slower).
    await _restored(backend, tokens(2 * backend.limits.block_size), "warm-up")
    samples = []
    limit = backend.limits.max_model_len - 1
    for repeat in range(repeats):
        for size in (s for s in sizes if s <= limit):
            restore = await _restored(backend, tokens(size), f"restore-{size}-{repeat}")
            samples.append(
                RestoreSample(
                    tokens=size,
                    computed=restore.computed_tokens,
                    seconds=restore.seconds,
                    unix_time=time.time(),
                    load_1min=os.getloadavg()[0],
                )
            )
    return samples
