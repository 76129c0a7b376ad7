"""The environment vLLM reads when an engine starts: it must be set before the engine spawns
its engine-core process, which inherits it."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from wim_service.engine.config import EngineConfig
from wim_service.engine.kv_transfer.documents import MAX_GIB_ENV, STORE_ENV

if TYPE_CHECKING:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM


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
    # (the front end for its EngineCore, the EngineCore for any worker processes). Its 5 s default,
    # nested, was the whole of a stopped command's exit time: an EngineCore takes longer than
    # that to end on SIGTERM, and defers it altogether while the model loads.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "2")


def start_async_llm(args: AsyncEngineArgs) -> AsyncLLM:
    """`AsyncLLM.from_engine_args(args)` with the model run in the engine-core process itself.

    On a CPU vLLM turns the in-process executor ("uni") into a process per worker ("mp"),
    because OpenMP reads its thread count and binding once, when a process loads it: the
    worker is spawned with them set. With one worker the engine core can be that process: the
    same settings, from vLLM's own `OMPProcessManager`, are set while the engine core is
    spawned. A process fewer per engine: one import of vLLM and one copy of the model's
    process state fewer, and no shared-memory queue between two processes at every step
    (docs/deploy.md, "On one machine", has the start time and memory it saves).
    """
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM

    if not current_platform.is_cpu() or args.distributed_executor_backend is not None:
        return AsyncLLM.from_engine_args(args)
    args = copy.copy(args)  # the caller's stay as given
    args.distributed_executor_backend = "uni"
    with environ_kept("VLLM_ENABLE_V1_MULTIPROCESSING"):  # read only by the platform's check
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        return AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.ENGINE_CONTEXT,
            disable_log_stats=args.disable_log_stats,
        )


@contextmanager
def environ_kept(*names: str) -> Iterator[None]:
    """The environment variables `names`, whatever the block sets, as they were after it."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
