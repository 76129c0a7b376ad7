"""The environment an engine starts in, and what is put back after, read back (no engine is
started)."""

from __future__ import annotations

import os

import pytest

from wim_service.engine.config import EngineConfig
from wim_service.engine.process_env import configure_process_env, environ_kept


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A copy of the environment for configure_process_env to write, without OpenMP's policy."""
    copy = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    monkeypatch.setattr(os, "environ", copy)
    return copy


def test_openmp_threads_sleep_when_idle_unless_the_environment_says(environ) -> None:
    configure_process_env(EngineConfig())
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE"
    environ["OMP_WAIT_POLICY"] = "ACTIVE"
    configure_process_env(EngineConfig())
    assert environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_what_a_block_sets_in_the_environment_is_put_back(environ) -> None:
    environ["WIM_TEST_KEPT"] = "before"
    environ.pop("WIM_TEST_ABSENT", None)
    with pytest.raises(RuntimeError), environ_kept("WIM_TEST_KEPT", "WIM_TEST_ABSENT"):
        environ["WIM_TEST_KEPT"] = "during"
        environ["WIM_TEST_ABSENT"] = "during"
        raise RuntimeError("the block fails")
    assert environ["WIM_TEST_KEPT"] == "before"
    assert "WIM_TEST_ABSENT" not in environ
