"""An engine replica's Serve log survives its vLLM engine (`keep_serve_logs_from_vllm`).

vLLM's logging config, applied when its engine is built, closes every handler of the process:
Serve's replica logger (a memory handler over the replica's log file) lost its file, the
replica's log stopped, and a restarted Serve controller, asking the replica for that file's
path, replaced every engine replica. The test sets up Serve's logger as a replica has it, in a
fresh interpreter (vLLM applies its config once per process), and builds vLLM's logging as its
engine does (~20 s: vLLM's import).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

REPLICA = textwrap.dedent(
    """
    import logging, logging.handlers, sys

    from wim_service.serving.observability.logs import SERVE_LOGGER, keep_serve_logs_from_vllm

    memory = logging.handlers.MemoryHandler(1, target=logging.FileHandler(sys.argv[1]))
    serve_logger = logging.getLogger(SERVE_LOGGER)
    serve_logger.addHandler(memory)
    serve_logger.setLevel(logging.INFO)
    keep_serve_logs_from_vllm()

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed, init_logger

    configure_logging_if_needed(LoggingConfig())  # as vLLM's engine does when it is built
    init_logger("vllm.engine_test").info("an engine line")
    serve_logger.info("a replica line")
    print("target kept" if memory.target is not None else "target closed")
    """
)


def test_the_replica_log_outlives_vllms_logging_config(tmp_path: Path) -> None:
    log = tmp_path / "replica.log"
    done = subprocess.run(
        [sys.executable, "-c", REPLICA, str(log)],
        capture_output=True,
        text=True,
        timeout=170,
        check=True,
    )
    assert "target kept" in done.stdout, done.stdout + done.stderr
    lines = log.read_text()
    assert "an engine line" in lines and "a replica line" in lines
