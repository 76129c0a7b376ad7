"""`wim bench --kv-restore`: what restoring a document's stored KV saves (docs/kv-store.md).

(j) restore / re-read of one document on one engine, round by round: the document (the
    sample report repeated, its first 4,096 tokens, or as many as the engine's window holds)
    is read segment by segment into a context without a store (the re-read a rebuild did
    before), read again into a stored context (saved as it is read), and restored into a
    fresh context (another cache salt: nothing comes from the prefix cache). The ratio is
    taken per round; rounds alternate which read runs first, so that drifting load hits
    both alike.

The engine is started from the engine flags with a temporary directory KV store sealed with a
random key (`calibration.restores.temporary_kv_store`), removed afterwards: its files are in
the page cache, as a document another engine saved moments before is.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from wim_service.benchmarks.common import BenchSettings, line
from wim_service.benchmarks.intervals import RoundsInterval, t_interval
from wim_service.engine.calibration.restores import (
    read_document,
    restore_document,
    temporary_kv_store,
)
from wim_service.wim.backend import StoredDocument

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend

# The document: a re-read of 4,096 tokens takes seconds in the shipped profile
# (docs/kv-store.md).
DOCUMENT_TOKENS = 4096


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def document_ids(backend: VLLMBackend, settings: BenchSettings) -> list[int]:
    """The sample document's first 4,096 tokens (or the engine window's), repeated as long as
    it takes to have them."""
    tokens = min(DOCUMENT_TOKENS, backend.limits.max_model_len - 1)
    text = settings.context.read_text(encoding="utf-8")
    ids = backend.tokenizer.encode_user_text(text).ids
    return (ids * (tokens // len(ids) + 1))[:tokens]


async def _round(backend: VLLMBackend, ids: list[int], n: int) -> dict[str, float]:
    doc = StoredDocument("bench", f"restore-bench-{n}")
    timed: dict[str, float] = {}
    # Even rounds re-read first, odd rounds last.
    if n % 2 == 0:
        timed["re_read_s"] = await read_document(backend, ids, None)
    timed["read_saving_s"] = await read_document(backend, ids, doc)
    restore = await restore_document(backend, ids, doc)
    if n % 2:
        timed["re_read_s"] = await read_document(backend, ids, None)
    await backend.delete_stored(doc)
    timed |= {"restore_s": restore.seconds, "computed_tokens": restore.computed_tokens}
    return timed | {"ratio": restore.seconds / timed["re_read_s"]}


async def bench_restore(backend: VLLMBackend, settings: BenchSettings) -> dict[str, Any]:
    """(j) on a running engine with a KV store: every round, and their medians and interval."""
    ids = document_ids(backend, settings)
    print(f"(j) restore / re-read of one {len(ids):,}-token document", flush=True)
    rounds = []
    for n in range(settings.rounds):
        rounds.append(await _round(backend, ids, n))
        timed = rounds[-1]
        line(
            f"round {n}: re-read / read saving / restore",
            f"{timed['re_read_s']:.2f} s / {timed['read_saving_s']:.2f} s / "
            f"{timed['restore_s']:.3f} s",
        )
    ratios = [r["ratio"] for r in rounds]
    return {
        "document_tokens": len(ids),
        "rounds": rounds,
        **{
            key: statistics.median(r[key] for r in rounds)
            for key in ("re_read_s", "read_saving_s", "restore_s", "computed_tokens")
        },
        "ratio": statistics.median(ratios),
        "ratio_interval": asdict(t_interval(ratios)),
    }


def print_restore(result: dict[str, Any]) -> None:
    line("re-read (median of rounds)", f"{result['re_read_s']:.2f} s")
    line("read while saving (median of rounds)", f"{result['read_saving_s']:.2f} s")
    line(
        "restore (median of rounds; tokens computed)",
        f"{result['restore_s']:.3f} s; {result['computed_tokens']:.0f}",
    )
    line("restore / re-read (median of rounds)", f"{result['ratio']:.3f}")
    line("restore / re-read, mean of rounds", str(RoundsInterval(**result["ratio_interval"])))


async def run_restore_bench(settings: BenchSettings) -> int:
    from wim_service.engine.vllm_engine import VLLMBackend

    argv = ["--kv-restore", f"--rounds {settings.rounds}", *settings.engine.cli_argv()]
    results: dict[str, Any] = {"command": "wim bench " + " ".join(argv), "load_start": _load()}
    with temporary_kv_store(settings.engine) as config:
        backend = VLLMBackend.start(config)
        try:
            results["dtype"] = backend.dtype
            print(f"wim bench --kv-restore: {settings.context.name}, dtype {backend.dtype}")
            results["j_restore"] = await bench_restore(backend, settings)
        finally:
            backend.shutdown()
    print_restore(results["j_restore"])
    results["load_end"] = _load()
    loads = f"{results['load_start']} / {results['load_end']}"
    line("load average (1, 5, 15 min) at the start / the end", loads)
    settings.save(results)
    return 0
