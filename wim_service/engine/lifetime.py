"""Processes that end when the process that started them ends (Linux `PR_SET_PDEATHSIG`).

vLLM starts its EngineCore with multiprocessing and never watches the parent: when the
parent dies without calling `AsyncLLM.shutdown()` (SIGKILL, the OOM killer, a Ray worker
whose raylet went away) the EngineCore lives on with parent pid 1 and the model in memory
(seen for 83 minutes). Worker processes (a GPU's; on a CPU the model runs in the EngineCore
itself, `process_env.start_async_llm`) watch the EngineCore through vLLM's death pipe, which
did not end one for ~3 minutes. So each of them asks the kernel for SIGKILL on its parent's
death, from the first code of ours that runs in it: `WiMScheduler.__init__` in the
EngineCore, the import of `engine/kv_memory.py` (the workers' extension) in a worker.

SIGKILL rather than SIGTERM: nobody is left to read the engine's answers, and vLLM's EngineCore
defers SIGTERM until its construction ends (tens of seconds of model loading).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import sys

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (`parent_pid`) ends; at once if it already has.

    The kernel watches the parent *thread* that started this process: start it from a thread
    that lives as long as its process (the main thread, Serve's user-code thread). Also safe
    as a `subprocess` `preexec_fn` of a single-threaded parent (it only calls prctl and kill).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:  # the parent ended before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_multiprocessing_parent() -> None:
    """`die_with_parent` in a process started by `multiprocessing` (vLLM's EngineCore); in a
    main process nothing: its lifetime is whoever started it's business."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)


def dies_with_this_thread(argv: list[str]) -> list[str]:
    """`argv` wrapped so that the program gets SIGKILL when the thread that starts it ends
    (`setpriv --pdeathsig`, util-linux): a helper server (redis-server) never outlives the
    test or benchmark that started it, even one killed by a signal. No `preexec_fn`, which is
    unsafe in a process with threads. Start it from a thread that lives as long as its
    process (the main thread); without setpriv (not Linux), `argv` as it is."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return argv if setpriv is None else [setpriv, "--pdeathsig", "KILL", "--", *argv]
