"""A SIGTERM to the test run's process alone (tests/interrupt.py) ends the run and everything
it started: its fixtures' finalizers run, in one process and under xdist (`./test.sh`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

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
    time.sleep(12)  # as long as a real stack's shutdown
    process.terminate()
    process.wait()


def test_one(child):
    time.sleep(600)


def test_two(child):
    time.sleep(600)
"""


def started(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sigterm_ends_the_run_and_what_it_started(tmp_path: Path, workers: int) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    pids = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STARTED": str(pids)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    argv += ["-n", str(workers), "-q", str(tmp_path)]
    run = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # One session fixture per process that runs tests: each xdist worker runs one test.
    expected = max(workers, 1)
    deadline = time.monotonic() + 120
    while len(started(pids)) < expected:
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, "the inner tests never started"
        time.sleep(0.2)
    workers_seen = psutil.Process(run.pid).children()
    run.send_signal(signal.SIGTERM)  # to the run's process alone, not its process group
    output, _ = run.communicate(timeout=90)
    assert run.returncode != 0, output
    survivors = [pid for pid in started(pids) if psutil.pid_exists(pid)]
    survivors += [w.pid for w in workers_seen if w.is_running() and w.status() != "zombie"]
    assert not survivors, output
