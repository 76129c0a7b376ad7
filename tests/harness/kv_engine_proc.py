"""An engine process for tests/engine/kv_transfer/test_kv_restore.py:
`python -m tests.harness.kv_engine_proc ROLE STORE`.

`save`: read the test document into a stored context segment by segment, ask the same greedy
margins and answer the test asks everywhere, print them, then wait to be killed. `restore`
(a directory store): restore the document on a fresh engine, ask them again, then run each
fallback (another tenant, other tokens, a tampered block, a store that is down) and the
deletion. `restore-redis STORE GO` (a Redis store): restore, then a restore while the test
holds the server paused, then the deletion, each after the test writes to the FIFO `GO`.
Each outcome is one `RESULT {json}` line on stdout; the test reads them from the log.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import EXAMPLES, OWN_ENGINE_CORE
from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.keys import KVCipher, StoredDocument, master_key_from_env
from wim_service.wim.backend import GenerationParams, RequestKind

DOC = StoredDocument("tenant-a", "doc-kv-1")
SEGMENT_TOKENS = 500  # not a multiple of the block size: pushes end inside blocks
MARGIN_TOKENS, ANSWER_TOKENS = 12, 16


# The engines' dtype: float32 unless the test asks for another (`KV_TEST_DTYPE`).
DTYPE_ENV = "KV_TEST_DTYPE"


def engine_config(store: str) -> EngineConfig:
    return EngineConfig(
        dtype=os.environ.get(DTYPE_ENV, "float32"),
        max_model_len=4096,
        kv_cache_gib=0.5,
        max_sessions=4,
        max_num_seqs=16,
        kv_store=store,
        cpu_threads_bind=OWN_ENGINE_CORE,
    )


def document_ids(backend: Any) -> list[int]:
    """The harbor report: about 1,200 tokens, three segments (the last one short). Longer
    only makes each of the test's reads slower (bfloat16's most: emulated on most CPUs)."""
    return backend.tokenizer.encode_template_text((EXAMPLES / "harbor_report.txt").read_text())


def result(kind: str, **fields: Any) -> None:
    print("RESULT " + json.dumps({"kind": kind, **fields}), flush=True)


async def _ask(context: Any, backend: Any, ids: list[int], margins: bool = True) -> dict[str, Any]:
    """Greedy margins at every segment end (unless not `margins`) and an answer after the
    whole document, as WiM asks them: same-salt branches over the context."""
    margin = backend.tokenizer.encode_template_text("\nIn one sentence, this part says:")
    query = backend.tokenizer.encode_template_text("\nQuestion: Which ships are named?\nAnswer:")
    ends = [*range(SEGMENT_TOKENS, len(ids), SEGMENT_TOKENS), len(ids)] if margins else []
    outputs, cached = [], []
    for end, suffix, tokens in [(e, margin, MARGIN_TOKENS) for e in ends] + [
        (len(ids), query, ANSWER_TOKENS)
    ]:
        params = GenerationParams(RequestKind.ANSWER, tokens, frozenset())
        out: list[int] = []
        async for chunk in context.branch(end, suffix, params):
            out += chunk.token_ids
            if chunk.cost is not None:
                cached.append(chunk.cost.cached)
        outputs.append(out)
    return {"margins": outputs[:-1], "answer": outputs[-1], "cached": cached}


async def _read(context: Any, ids: list[int]) -> float:
    started = time.perf_counter()
    for start in range(0, len(ids), SEGMENT_TOKENS):
        await context.extend(ids[start : start + SEGMENT_TOKENS])
    return time.perf_counter() - started


async def save(backend: Any) -> None:
    ids = document_ids(backend)
    context = await backend.open_context(reserve_blocks=200, stored=DOC)
    seconds = await _read(context, ids)
    report = await context.kv_report()
    asked = await _ask(context, backend, ids)
    result("saved", tokens=len(ids), saved_tokens=report.saved_tokens, read_s=seconds, **asked)
    await asyncio.Event().wait()  # holds the document until the test kills this process


async def _case(
    backend: Any, kind: str, doc: StoredDocument, ids: list[int], *, margins: bool = False
) -> None:
    """Restore `doc` from `ids`; read it as usual when nothing was pushed; ask; report."""
    context = await backend.open_context(reserve_blocks=200, stored=doc)
    try:
        restore = await context.restore(ids)
        read_s = 0.0 if restore.holds_document else await _read(context, ids)
        asked = await _ask(context, backend, ids, margins)
        result(kind, restore=restore.__dict__, read_s=read_s, **asked)
    finally:
        await context.close()


def _tamper_one_block(store: Path) -> None:
    key = master_key_from_env()
    assert key is not None
    folder = store / KVCipher(key).storage_id(DOC)
    (block,) = [p for p in folder.iterdir() if p.name.endswith("-r0-000020")]
    data = bytearray(block.read_bytes())
    data[len(data) // 2] ^= 0xFF
    block.write_bytes(bytes(data))


async def restore(backend: Any, store: Path) -> None:
    ids = document_ids(backend)
    await _case(backend, "restored", DOC, ids, margins=True)
    await _case(
        backend, "wrong_tenant", StoredDocument("tenant-b", DOC.document), ids, margins=True
    )
    moved = store.with_name("moved-away")
    os.replace(store, moved)
    store.write_text("a file where the store's directory was: every read fails")
    try:
        await _case(backend, "store_down", DOC, ids)
    finally:
        store.unlink()
        os.replace(moved, store)
    _tamper_one_block(store)
    await _case(backend, "tampered", DOC, ids)  # recomputed, and saved again
    await _case(backend, "repaired", DOC, ids)
    await _case(backend, "wrong_digest", DOC, [ids[0], ids[2], *ids[2:]])
    deleted = [
        await backend.delete_stored(d) for d in (DOC, StoredDocument("tenant-b", DOC.document))
    ]
    left = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    result("deleted", deleted=deleted, left=left)
    context = await backend.open_context(reserve_blocks=200, stored=DOC)
    result("after_delete", restore=(await context.restore(ids)).__dict__)
    await context.close()


async def restore_redis(backend: Any, go: Path) -> None:
    """Restore from Redis; then, each time the test says go (it pauses, then resumes the
    server), a restore that finds the store down, and the deletion."""
    ids = document_ids(backend)
    await _case(backend, "restored", DOC, ids, margins=True)
    await asyncio.to_thread(go.read_text)  # a FIFO: returns when the test has paused Redis
    await _case(backend, "store_down", DOC, ids)
    await asyncio.to_thread(go.read_text)  # resumed
    result("deleted", deleted=[await backend.delete_stored(DOC)])


def main() -> None:
    from wim_service.engine.vllm_engine import VLLMBackend

    role, store = sys.argv[1], sys.argv[2]
    backend = VLLMBackend.start(engine_config(store))
    try:
        if role == "save":
            asyncio.run(save(backend))
        elif role == "restore":
            asyncio.run(restore(backend, Path(store)))
        else:
            asyncio.run(restore_redis(backend, Path(sys.argv[3])))
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
