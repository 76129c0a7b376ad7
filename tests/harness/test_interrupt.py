"""A SIGTERM to the test run's process, alone or with its process group
(tests/harness/interrupt.py), ends the run and everything it started: its fixtures'
finalizers run, in one process and under xdist (`./test.sh`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# The run's own hooks, and a session fixture whose process only its finalizer ends, after a
# while: once its controller is gone, an xdist worker is ended before a 12 s finalizer is done
# (a 5 s one it finishes), unless the controller waits for it.
INNER_CONFTEST = "from tests.conftest import pytest_configure, pytest_unconfigure  # noqa: F401\n"
INNER_TESTS = """
import os
import subprocess
import time

import pytest


@pytest.fixture(scope="session")
def child():
    process = subprocess.Popen(["sleep", "600"])
    with open(os.environ["STARTED"], "a") as started:
        started.write(f"{process.pid}\\n")
    yield process
    with open(os.environ["FINALIZING"], "a") as finalizing:
        finalizing.write(f"{process.pid}\\n")
    time.sleep(12)  # as long as a real stack's shutdown
    process.terminate()
    process.wait()


def test_one(child):
    time.sleep(600)


def test_two(child):
    time.sleep(600)
"""


def pids_in(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


def wait_for_pids(path: Path, count: int, run: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while len(pids_in(path)) < count:
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, f"the inner run never {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("group", [False, True], ids=["to the run alone", "to its group"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sigterm_ends_the_run_and_what_it_started(
    tmp_path: Path, workers: int, group: bool
) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    pids, finalizing = tmp_path / "started", tmp_path / "finalizing"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STARTED": str(pids)}
    env["FINALIZING"] = str(finalizing)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    argv += ["-n", str(workers), "-q", str(tmp_path)]
    run = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, apart from this test's
    )
    # One session fixture per process that runs tests: each xdist worker runs one test.
    expected = max(workers, 1)
    wait_for_pids(pids, expected, run, "started its tests")
    workers_seen = psutil.Process(run.pid).children()

    def terminate() -> None:
        if group:  # as CI cancelling a job: every process of the group at once
            os.killpg(run.pid, signal.SIGTERM)
        else:
            run.send_signal(signal.SIGTERM)

    terminate()
    # A second SIGTERM while the finalizers run (under xdist a worker gets one from its
    # group and one from its controller) must not cut them short.
    wait_for_pids(finalizing, expected, run, "began its finalizers")
    terminate()
    output, _ = run.communicate(timeout=90)
    assert run.returncode != 0, output
    survivors = [pid for pid in pids_in(pids) if psutil.pid_exists(pid)]
    survivors += [w.pid for w in workers_seen if w.is_running() and w.status() != "zombie"]
    assert not survivors, output
