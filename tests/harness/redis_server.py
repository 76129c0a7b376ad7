"""A real `redis-server` for tests: loopback (or a given address), a free port, a password of
its own (`url` carries it), no persistence, stopped after use.

The binary comes from the Debian package `redis-server` (scripts/bootstrap.sh installs it as
root). Without it the Redis tests skip on a developer machine and fail in CI (`CI=true`):
CI must not pass by skipping them.
"""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.harness.system_tools import end, system_tool
from wim_service.engine.lifetime import dies_with_this_thread


def redis_binary() -> str:
    return system_tool(
        "redis-server", "redis-server", "test the Redis session store on a real Redis"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, binary: str, workdir: Path, host: str = "127.0.0.1") -> None:
        """`host`: the address it listens on (loopback, or a bridge other network
        namespaces reach it through)."""
        self.binary = binary
        self.workdir = workdir
        self.host = host
        self.port = free_port(host)
        # As a deployment runs it (docs/deploy.md): on a test bridge other network namespaces
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
        end(self.process)
        self.process = None
