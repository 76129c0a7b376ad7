"""A real `redis-server` for tests: the package's one launcher
(`wim_service/benchmarks/redis_server.py`: loopback or a given address, a free port, a password
of its own, no persistence, stopped after use), and how a test finds its binary.

The binary comes from the Debian package `redis-server` (scripts/bootstrap.sh installs it as
root). Without it the Redis tests skip on a developer machine and fail in CI (`CI=true`):
CI must not pass by skipping them.
"""

from __future__ import annotations

from tests.harness.system_tools import system_tool
from wim_service.benchmarks.redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port", "redis_binary"]


def redis_binary() -> str:
    return system_tool(
        "redis-server", "redis-server", "test the Redis session store on a real Redis"
    )
