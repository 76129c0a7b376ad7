"""The Debian programs some tests need (scripts/bootstrap.sh installs them as root): their
path, or a skip on a developer machine without them, or a failure in CI (`CI=true`), which
must not pass by skipping them; and how a test's server of theirs ends."""

from __future__ import annotations

import os
import shutil

import pytest

from wim_service.benchmarks.redis_server import end_process


def system_tool(program: str, package: str, checks: str) -> str:
    """`program`'s path; without it, skip (fail under CI) saying that `checks` need it."""
    path = shutil.which(program)
    if path is None:
        reason = (
            f"{program} is not installed: ./test.sh installs it when run as root, or "
            f"`apt-get install {package}` (Debian)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must {checks}; {reason}")
        pytest.skip(reason)
    return path


# How a test's server ends: SIGTERM, then SIGKILL if it has not ended within 10 s.
end = end_process
