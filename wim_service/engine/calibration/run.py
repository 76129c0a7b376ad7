"""A calibration run: start one engine, take every kind of sample on it, fit the profile.

`calibrate` measures a profile from scratch (`wim calibrate --out FILE`), or only the restore
cost into a profile measured before (`restore_into`, `wim calibrate --restore-only`). The
engine runs with a temporary KV store of its own (`restores.py`) and always ends with the run.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from wim_service.engine.calibration.fit import fit_decode, fit_prefill, fit_query_extra, fit_restore
from wim_service.engine.calibration.probe import FULL, QUICK, Probe, measure
from wim_service.engine.calibration.queries import measure_queries
from wim_service.engine.calibration.restores import measure_restores, temporary_kv_store
from wim_service.engine.config import EngineConfig
from wim_service.placement.profile import EngineProfile, RestoreSample, Sample
from wim_service.wim.capacity import JobShape
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend

# A typical 10-word query: margin_prompt_tokens counts the query's tokens in the margin prompt.
TYPICAL_QUERY = "What is the access code for the night gate at the harbor?"


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model and core count, as a profile records it."""
    name = "unknown CPU"
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def model_name(config: EngineConfig) -> str:
    """The model's name: its folder's, or the offline default model's."""
    from wim_service.assets.default_model import GGUF_FILE

    return Path(config.model).name if config.model else GGUF_FILE.partition(".")[0]


def margin_prompt_tokens(builder: PromptBuilder, options: WiMOptions | None = None) -> int:
    """What a margin adds after its segment with the default prompts and a typical query,
    as the job's KV bound counts it (`JobShape`, with its allowance for merges at the
    query's edges)."""
    shape = JobShape.of(
        builder,
        context_tokens=0,
        document_tokens=0,
        segments=1,
        options=options or WiMOptions(),
        query=TYPICAL_QUERY,
    )
    return shape.margin_prompt_tokens


def build_profile(
    backend: VLLMBackend, samples: list[Sample], load: Sequence[float]
) -> EngineProfile:
    """The profile of a running engine: its sizes, and costs fitted to `samples`."""
    config = backend.engine.vllm_config
    cache = config.cache_config
    builder = PromptBuilder(backend.tokenizer, WiMOptions().prompts)
    profile = EngineProfile(
        model=model_name(backend.config),
        dtype=backend.dtype,
        machine=machine(),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        load_average=(load[0], load[1], load[2]),
        block_tokens=cache.block_size,
        # vLLM's block 0 is a null block that never holds KV.
        kv_capacity_tokens=((cache.num_gpu_blocks or 1) - 1) * cache.block_size,
        max_batch=config.scheduler_config.max_num_seqs,
        margin_prompt_tokens=margin_prompt_tokens(builder),
        prefill=fit_prefill(samples),
        decode=fit_decode(samples),
        restore=fit_restore(samples),
        samples=samples,
    )
    return profile.model_copy(update={"query_extra_tokens": fit_query_extra(profile)})


def _max_load(*loads: Sequence[float]) -> list[float]:
    return [max(values) for values in zip(*loads, strict=True)]


async def calibrate_on(backend: VLLMBackend, *, quick: bool = False) -> EngineProfile:
    """Measure and fit the costs of a running engine (it stays up)."""
    load = os.getloadavg()
    plan = QUICK if quick else FULL
    queries = await measure_queries(backend, plan.query_documents, plan.queries_per_document)
    samples = await measure(backend, plan) + queries
    samples += await measure_restores(backend, Probe(backend, seed=1).tokens, quick=quick)
    return build_profile(backend, samples, _max_load(load, os.getloadavg()))


async def calibrate(
    config: EngineConfig, *, quick: bool = False, restore_into: EngineProfile | None = None
) -> EngineProfile:
    """Start one engine with `config`, measure and fit its costs (with `restore_into`, only
    its restores, into that profile), end the engine.

    `quick` measures fewer sizes once each (for tests); how long each plan takes:
    docs/routing.md ("wim sim", the calibration).
    """
    from wim_service.engine.vllm_engine import VLLMBackend

    with temporary_kv_store(config) as stored:
        backend = VLLMBackend.start(stored)
        # Always ends the engine: errors, cancels, the CLI's KeyboardInterrupt on SIGTERM.
        try:
            if restore_into is None:
                return await calibrate_on(backend, quick=quick)
            if mismatch := restore_into.dtype_mismatch(backend.dtype):
                raise ValueError(f"cannot add restores: {mismatch}")
            samples: list[Sample] = [
                s for s in restore_into.samples if not isinstance(s, RestoreSample)
            ]
            samples += await measure_restores(backend, Probe(backend, seed=1).tokens, quick=quick)
            update = {"samples": samples, "restore": fit_restore(samples)}
            return restore_into.model_copy(update=update)
        finally:
            backend.shutdown()
