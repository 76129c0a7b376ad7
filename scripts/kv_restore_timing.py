"""Restore time against re-read time of the same document, on one engine, in one run.

    .venv/bin/python scripts/kv_restore_timing.py --rounds 3 --dtype float32

Each round reads a 4,096-token document segment by segment (1,024 tokens a push) without a
store, again into a stored context (write-through saving), then restores it into a fresh
context (another cache salt: nothing comes from the prefix cache) and prints the three wall
times. The store is a temporary directory (the page cache holds what was just written, as it
would on a replica that restores a document another engine saved moments before).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.keys import StoredDocument

TOKENS, SEGMENT = 4096, 1024
REPORT = Path(__file__).resolve().parent.parent / "examples" / "harbor_report.txt"


def _load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


async def _read(backend: Any, ids: list[int], stored: StoredDocument | None) -> float:
    context = await backend.open_context(reserve_blocks=160, stored=stored)
    started = time.perf_counter()
    for start in range(0, len(ids), SEGMENT):
        await context.extend(ids[start : start + SEGMENT])
    seconds = time.perf_counter() - started
    await context.close()
    return seconds


async def _restore(backend: Any, ids: list[int], stored: StoredDocument) -> tuple[float, int]:
    context = await backend.open_context(reserve_blocks=160, stored=stored)
    restore = await context.restore(ids)
    await context.close()
    assert restore.fallback is None, restore
    return restore.seconds, restore.computed_tokens


async def _rounds(backend: Any, rounds: int) -> None:
    text = REPORT.read_text()
    ids = backend.tokenizer.encode_template_text("\n\n".join([text] * 4))[:TOKENS]
    rows = []
    for n in range(rounds):
        doc = StoredDocument("bench", f"doc-{n}")
        plain = await _read(backend, ids, None)
        saving = await _read(backend, ids, doc)
        restore, computed = await _restore(backend, ids, doc)
        rows.append((plain, saving, restore))
        print(
            f"round {n}: re-read {plain:.2f} s, re-read saving {saving:.2f} s, "
            f"restore {restore:.3f} s ({computed} tokens computed), "
            f"restore/re-read {restore / plain:.3f}"
        )
    for name, column in zip(
        ("re-read", "re-read saving", "restore"), zip(*rows, strict=True), strict=True
    ):
        print(
            f"{name}: mean {statistics.mean(column):.3f} s, "
            f"min {min(column):.3f}, max {max(column):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from wim_service.engine.vllm_engine import VLLMBackend

    os.environ.setdefault("WIM_KV_MASTER_KEY", base64.b64encode(secrets.token_bytes(32)).decode())
    with tempfile.TemporaryDirectory() as store:
        config = EngineConfig(
            dtype=args.dtype,
            max_model_len=5120,
            kv_cache_gib=1.0,
            max_sessions=4,
            max_num_seqs=16,
            kv_store=store,
        )
        backend = VLLMBackend.start(config)
        try:
            print(f"dtype {backend.dtype}, load average {_load_average()}")
            asyncio.run(_rounds(backend, args.rounds))
            print(f"load average {_load_average()}")
        finally:
            backend.shutdown()


if __name__ == "__main__":
    main()
