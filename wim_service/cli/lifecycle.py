"""Stop a command on SIGTERM or SIGINT: in order when it can, within `GRACE_S` in any case.

A command's engine runs in child processes (vLLM's EngineCore, which also runs the model on
a CPU; for `wim serve` a whole local Ray cluster). A command ended by SIGTERM's default
action never reaches its `finally: backend.shutdown()`, and those processes live on with the
model in memory (seen for 83 minutes after a `pkill` of `wim eval`). asyncio's own way,
cancelling the main task, waits for the event loop to get control back, and the engine's
start blocks it for tens of seconds (docs/reliability.md, "Process hygiene: what a signal
ends").

So either signal raises `Interrupted` (a KeyboardInterrupt, as Ctrl-C does without asyncio)
wherever the main thread is: an engine start unwinds at once, and in the event loop
`asyncio.run` cancels the command's task, whose `finally` shuts its engine down. Whatever that
leaves running (an engine interrupted mid-start, one whose shutdown hangs) is killed with the
command's process tree when the stop is done, and the command exits at once: after a signal
the interpreter's own exit (vLLM's, Ray's and gRPC's exit hooks and threads) was seen hanging
past any deadline. A stop that takes longer than `GRACE_S` (a main thread still waiting in
vLLM's start-up, `serve run` shutting Serve down) is cut short by a watchdog thread, which
kills the tree and exits; faulthandler's, which needs no GIL, exits two seconds later.

The watchdog prints where the threads were only for a stop that hung. A command that runs its
work in a child (`wim serve`) waits on that child, so a stop still under way is a normal one:
`serve run` stops the router replicas, then the engine replicas and Ray, and Serve's stop
outlasts `GRACE_S` (docs/reliability.md, *Process hygiene*); its processes ending is the sign
that it goes on, and only a child's stop in which none of them ended is a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, NoReturn

import psutil

from wim_service.engine.lifetime import die_with_parent

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What the orderly stop gets before the watchdog kills the process tree and exits: vLLM's
# shutdown takes ~2 s (engine/process_env.py); `serve run`'s would outlast the 10 s that a
# supervisor (or tests/cli/test_signals.py) gives before it kills.
GRACE_S = 5.0
# How often the stopping command records its descendants (see `_Stop.record`).
RECORD_INTERVAL_S = 0.2


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(signum.name)
        self.signum = signum


def refused(exc: Exception) -> int:
    """Bad input found before any work started: one line on stderr, no traceback, status 2."""
    print(f"wim: {exc}", file=sys.stderr)
    return 2


def kill_processes(processes: Iterable[psutil.Process]) -> None:
    """SIGKILL `processes` (those still running). Not waited for: the kernel ends them, and a
    killed process whose parent is gone too stays a zombie until init reaps it."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()  # psutil checks the pid still names this process


class _Stop:
    """One command's stop: the signal that asked for it and every process it must end."""

    def __init__(self, child_stops: bool) -> None:
        self.signum: signal.Signals | None = None
        # Whether a child does the stopping (`run_subprocess`) and this process waits for it.
        self._child_stops = child_stops
        self._tree: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        # Held by whichever of the main thread and the watchdog finishes first; the other
        # waits on it until that one's exit.
        self._finishing = threading.Lock()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # a second Ctrl-C must not break the shutdown under way; the watchdog bounds it
        self.signum = signal.Signals(signum)
        self.record()
        threading.Thread(target=self._watchdog, name="wim-stop", daemon=True).start()
        raise Interrupted(self.signum)

    def record(self) -> None:
        """Add this process's descendants to those to end. Recorded as the stop goes on: a
        process whose parent has ended is re-parented and no longer found as a descendant."""
        with self._lock, contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process().children(recursive=True):
                self._tree.setdefault(child.pid, child)

    def _watchdog(self) -> None:
        faulthandler.dump_traceback_later(GRACE_S + 2, exit=True)
        threading.Thread(target=self._recorder, name="wim-stop-record", daemon=True).start()
        time.sleep(GRACE_S)
        if not (self._child_stops and self._some_ended()):
            print(
                f"wim: not stopped {GRACE_S:g} s after the signal; where it was:", file=sys.stderr
            )
            faulthandler.dump_traceback(sys.stderr)
        self.finish()

    def _some_ended(self) -> bool:
        """Whether a process of the tree has ended since it was recorded."""
        with self._lock:
            tree = list(self._tree.values())
        return any(map(_ended, tree))

    def _recorder(self) -> None:
        while True:
            self.record()
            time.sleep(RECORD_INTERVAL_S)

    def kill_recorded(self) -> None:
        with self._lock:
            tree = list(self._tree.values())
        kill_processes(tree)

    def finish(self) -> NoReturn:
        """Kill what is left of the tree and exit with 128 + the signal."""
        assert self.signum is not None
        self._finishing.acquire()
        # What is recorded dies first, then what a last walk of /proc finds: a walk can take
        # seconds on a starved machine, and walking first let faulthandler's deadline strike
        # before anything was killed, so the tree outlived the command (docs/reliability.md).
        self.kill_recorded()
        self.record()
        self.kill_recorded()
        print(f"wim: stopped by {self.signum.name}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + self.signum)


def _ended(process: psutil.Process) -> bool:
    """A process that ended (psutil knows the pid's process no longer runs) or that only waits
    for its parent to reap it."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def _stopping(child_stops: bool = False) -> Iterator[_Stop]:
    stop = _Stop(child_stops)
    previous = {signum: signal.signal(signum, stop.handle) for signum in SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_command(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)`; a SIGTERM or SIGINT stops it and exits with 128 + the signal."""
    with _stopping() as stop:
        try:
            status = asyncio.run(main)
            if stop.signum is None:
                return status
        except BaseException:
            if stop.signum is None:
                raise  # not stopped by a signal: not ours to hide
        stop.finish()


def run_subprocess(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run `argv` as this command; a SIGTERM or SIGINT reaches it as one SIGINT (Ctrl-C, which
    `serve run` answers by shutting Serve and its Ray down), and what it has not ended when
    the watchdog kills the tree (`GRACE_S`) is killed. Returns its status; after a signal
    exits with 128 + the signal."""
    with _stopping(child_stops=True) as stop:
        child: subprocess.Popen[bytes] | None = None
        try:
            child = subprocess.Popen(
                argv,
                env=env,
                # Its own process group: a terminal's Ctrl-C reaches it once, from here; a
                # second one would break its shutdown.
                process_group=0,
                # It ends with this process even if this one is killed outright.
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
            return child.wait()
        except Interrupted:
            if child is not None:
                child.send_signal(signal.SIGINT)
                child.wait()  # it ends, or the watchdog ends it and this process
        stop.finish()
