"""A command started in its own process group, with every process it ever started recorded:
what the signal tests (tests/cli/test_signals.py) stop and then look for.

Descendants are recorded while the tree is polled, not read once at the end: a process whose
parent died is re-parented to init and no longer shows up as a descendant, which is exactly
the survivor to catch (an orphaned vLLM EngineCore, Ray's raylet).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil


def is_engine_core(process: psutil.Process) -> bool:
    """vLLM's EngineCore process (its title, set by vLLM, is `VLLM::EngineCore`)."""
    with contextlib.suppress(psutil.Error):
        return "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline())
    return False


def ended(process: psutil.Process) -> bool:
    """Ended; a zombie counts as ended (it holds no memory and runs nothing)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def survivors(processes: Sequence[psutil.Process], deadline: float) -> list[str]:
    """Those of `processes` still running at `deadline` (`time.monotonic()`), described. A
    process sent SIGKILL runs until the kernel schedules it: on a busy machine it can still
    be running for a moment after the command that killed it has exited."""
    while True:
        alive = [p for p in processes if not ended(p)]
        if not alive or time.monotonic() >= deadline:
            return [_describe(p) for p in alive]
        time.sleep(0.05)


def _describe(process: psutil.Process) -> str:
    """Its pid, name, state and command line, and whether a SIGKILL waits for it: a survivor
    the stop killed but the kernel has not ended yet is told from one it never killed."""
    with contextlib.suppress(psutil.Error, OSError):
        state = (
            f"{process.status()}, SIGKILL {'pending' if _kill_pending(process.pid) else 'not sent'}"
        )
        return f"{process.pid} {process.name()} [{state}] {' '.join(process.cmdline())[:120]}"
    return f"{process.pid} (gone)"


def _kill_pending(pid: int) -> bool:
    """Whether SIGKILL is pending for the process: in its own or its group's mask
    (/proc/PID/status), until the kernel has taken it up."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        masks[key] = value.strip()
    pending = int(masks.get("SigPnd", "0"), 16) | int(masks.get("ShdPnd", "0"), 16)
    return bool(pending & (1 << (signal.SIGKILL - 1)))


class ProcessTree:
    """`argv` in a new session (its own process group), its output in `log`."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with log.open("wb") as out:
            self.root = subprocess.Popen(
                list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.seen: dict[int, psutil.Process] = {self.root.pid: psutil.Process(self.root.pid)}

    def record(self) -> list[psutil.Process]:
        """Add the root's current descendants to `seen`; return the ones still running."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in self.seen[self.root.pid].children(recursive=True):
                self.seen.setdefault(child.pid, child)
        return [p for p in self.seen.values() if not ended(p)]

    def output(self) -> str:
        """The end of what the command printed, for failure messages."""
        return self.log.read_text(errors="replace")[-3000:]

    def printed(self, text: str) -> bool:
        return text in self.log.read_text(errors="replace")

    def wait_for(self, found: Callable[[list[psutil.Process]], bool], timeout_s: float) -> None:
        """Record the tree until `found` holds for its running processes; fail if the root
        ends or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while not found(self.record()):
            status = self.root.poll()
            assert status is None, f"ended early ({status}):\n{self.output()}"
            assert time.monotonic() < deadline, f"not seen in {timeout_s} s:\n{self.output()}"
            time.sleep(0.2)

    def stop(self, signum: signal.Signals, within_s: float) -> float:
        """Send `signum` to the root alone (as `kill PID` does) and wait until no recorded
        process runs; return the seconds that took. Fails, naming the survivors, after
        `within_s`."""
        self.record()
        sent = time.monotonic()
        self.root.send_signal(signum)
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.root.wait(0.1)  # reap the root: it is this process's child
            alive = self.record()
            elapsed = time.monotonic() - sent
            if not alive:
                self.root.wait()  # a zombie already: sets its returncode
                return elapsed
            assert elapsed < within_s, (
                f"alive {within_s} s after {signum.name}:\n"
                + "\n".join(_describe(p) for p in alive)
                + f"\n{self.output()}"
            )

    def kill(self) -> None:
        """SIGKILL whatever of the tree still runs, so that a failed test leaves nothing."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.root.pid, signal.SIGKILL)
        for process in self.record():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.root.wait(10)
