"""A `redis-server` of our own, for `wim bench --store` and the tests: on loopback (or a given
address), a free port, a password of its own (`url` carries it), no persistence, ended with
the thread that started it (`engine/lifetime.py`) if not stopped before.

The one place the project starts Redis; `tests/harness/redis_server.py` adds only how a test
finds the binary (skipped on a developer machine without it, failed in CI).
"""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from wim_service.engine.lifetime import dies_with_this_thread

# What a stop waits for the server to end on SIGTERM before it kills it.
STOP_TIMEOUT_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def end_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if `process` has not ended within `STOP_TIMEOUT_S`."""
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RedisServer:
    def __init__(self, binary: str, workdir: Path, host: str = "127.0.0.1") -> None:
        """`binary`: the `redis-server` program; `workdir`: its working directory (nothing is
        saved there); `host`: the address it listens on (loopback, or a bridge other network
        namespaces reach it through)."""
        self.binary = binary
        self.workdir = workdir
        self.host = host
        self.port = free_port(host)
        # As a deployment runs it (docs/deploy.md): on a bridge other network namespaces
        # reach, and on loopback, nobody without the password gets in.
        self.password = secrets.token_hex(16)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain synchronous client, to look at raw keys."""
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start on this server's port (again, after `stop`) and wait until it answers PING."""
        self.process = subprocess.Popen(
            dies_with_this_thread(
                [
                    self.binary,
                    *("--port", str(self.port), "--bind", self.host),
                    *("--save", "", "--appendonly", "no", "--dir", str(self.workdir)),
                    *("--daemonize", "no", "--loglevel", "warning"),
                    # Protected mode refuses other hosts only while no password is set.
                    *("--requirepass", self.password, "--protected-mode", "yes"),
                ]
            ),
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on {self.url}") from None
                    time.sleep(0.05)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts connections but never answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        end_process(self.process)
        self.process = None
