"""Run a command's coroutine so that SIGTERM and Ctrl-C stop it the same way: cleanly.

vLLM runs its EngineCore in a child process. A command ended by SIGTERM's default action never
reaches its `finally: backend.shutdown()`, and that process lives on with parent pid 1 and the
model in memory (seen for 83 minutes after a `pkill` of `wim eval`). `asyncio.run` already
turns Ctrl-C into a cancelled main task, whose `finally` blocks run; SIGTERM is made to do the
same here, and both end with the shell's usual status instead of a traceback.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Coroutine
from typing import Any


def refused(exc: Exception) -> int:
    """Bad input found before any work started: one line on stderr, no traceback, status 2."""
    print(f"wim: {exc}", file=sys.stderr)
    return 2


def run_command(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)`; a SIGTERM or SIGINT cancels it and returns 128 + the signal."""
    received: list[signal.Signals] = []

    async def cancellable() -> int:
        task = asyncio.current_task()
        assert task is not None  # a coroutine run by asyncio.run is always a task

        def stop() -> None:
            received.append(signal.SIGTERM)
            task.cancel()

        # Delivered when the loop next runs: a blocking engine start finishes first, then the
        # command's next await raises CancelledError inside its try/finally.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        return await main

    try:
        return asyncio.run(cancellable())
    except KeyboardInterrupt:
        received.append(signal.SIGINT)
    except asyncio.CancelledError:
        if not received:
            raise  # cancelled by something else: not ours to hide
    print(f"wim: stopped by {received[0].name}", file=sys.stderr)
    return 128 + received[0].value
