"""A SIGTERM (CI cancelling the job, `kill PID`) ends a test run as Ctrl-C does: pytest stops,
every fixture's finalizer runs (engines, Ray, Redis, the multi-node cluster), and nothing the
run started outlives it (`tests/harness/test_interrupt.py`).

Under xdist (`./test.sh`), the controller passes the signal on to its workers and waits for
them; each worker stops as a plain run does and then leaves at once (an xdist worker otherwise
waits for its controller to dismiss it).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

import psutil

# How long the controller waits for its workers' finalizers (the real stack's shutdown takes
# ~20 s, the cluster's teardown ~10 s).
WORKERS_END_S = 120.0

_terminated = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _terminated
    if _terminated:
        # Already stopping; a second SIGTERM would cut the finalizers short. Under xdist one
        # always comes: a signal to the process group reaches a worker, then its controller's.
        return
    _terminated = True
    raise KeyboardInterrupt(f"signal {signum}")


def stop_run_on_sigterm() -> None:
    """From now on a SIGTERM stops the run. Call again after `ray.init`, which puts in a
    handler of its own (a SystemExit that fails one test and lets the run go on)."""
    signal.signal(signal.SIGTERM, _interrupt)


def leave_if_terminated(exitstatus: int) -> None:
    """In an xdist worker whose finalizers have run after a SIGTERM: end the process."""
    if _terminated:
        os._exit(exitstatus or 1)


def _end_workers_first(signum: int, frame: FrameType | None) -> None:
    workers = psutil.Process().children()
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    psutil.wait_procs(workers, timeout=WORKERS_END_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def workers_end_first_on_sigterm() -> None:
    """In xdist's controller: a SIGTERM goes to the workers, and once they have ended (or
    after `WORKERS_END_S`), ends the controller."""
    signal.signal(signal.SIGTERM, _end_workers_first)
