"""The environment vLLM reads when an engine starts: it must be set before the engine spawns
its engine-core process, which inherits it."""

from __future__ import annotations

import os

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import MAX_GIB_ENV, STORE_ENV


def threads_bind(setting: str, rank: int = 0) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` value for an EngineConfig.cpu_threads_bind setting."""
    cores = sorted(os.sched_getaffinity(0))
    if setting == "all":
        return ",".join(str(c) for c in cores)
    if setting == "rank":
        return str(cores[rank % len(cores)])
    return setting


def configure_process_env(config: EngineConfig, rank: int = 0) -> None:
    """Environment vLLM reads at engine start (it must be set before the engine spawns)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(config.cpu_threads_bind, rank)
    # The KV connector reads its store from the environment in the engine core and workers.
    if config.kv_store is not None:
        os.environ[STORE_ENV] = config.kv_store
    if config.kv_store_max_gib is not None:
        os.environ[MAX_GIB_ENV] = str(config.kv_store_max_gib)
    # OpenMP threads that sleep at once when a parallel region ends, instead of spinning for
    # GNU OpenMP's default 300,000 rounds: the engine's threads share their cores with its own
    # scheduler process and often with other engines, and a spinning thread takes the core
    # the one it waits for needs: engines ran faster with it on 2 cores, alone and more so
    # side by side (docs/deploy.md). A deployment may set its own.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's own usage-stats reporting would try the network.
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    # How long vLLM's shutdown waits for a process to end before it kills it, at each level
    # (the front end for its EngineCore, the EngineCore for its workers). Its 5 s default,
    # nested, was the whole of a stopped command's exit time: an EngineCore takes longer than
    # that to end on SIGTERM, and defers it altogether while the model loads.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "2")
