"""`wim calibrate`: its refusals of bad input, and a restore-only calibration of a real engine
run through the command (the fits' own tests: tests/engine/calibration/)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import OWN_ENGINE_CORE, TEST_ENGINE
from wim_service.cli import calibrate as calibrate_command
from wim_service.cli import main
from wim_service.engine.calibration.fit import fit_restore
from wim_service.engine.calibration.restores import QUICK_RESTORE_TOKENS
from wim_service.placement.profile import EngineProfile, RestoreSample


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "calibrate needs --out FILE"),
        (["--out", "{tmp}/p.json", "--profile", "{tmp}/p.json"], "with --restore-only only"),
        (["--out", "{tmp}/p.json", "--restore-only", "--profile", "{tmp}/no.json"], "no profile"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["calibrate", *(arg.format(tmp=tmp_path) for arg in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wim: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_a_signal_stops_it_as_every_command_that_starts_an_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It runs under `run_command` (cli/lifecycle.py), whose stop on SIGTERM or SIGINT
    tests/cli/test_cli.py checks: before, a SIGTERM ended it at once, and an EngineCore still
    importing (its parent-death signal not yet set) outlived it."""
    ran: list[str] = []

    def run_command(main: Coroutine[Any, Any, int]) -> int:
        ran.append(main.__qualname__)
        main.close()
        return 0

    monkeypatch.setattr(calibrate_command, "run_command", run_command)
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 0
    assert ran == ["calibrate_profile.<locals>.write_profile"]


@pytest.mark.engine
@pytest.mark.own_engines
@pytest.mark.timeout(600)
def test_a_restore_only_calibration_measures_real_restores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`wim calibrate --restore-only` starts one engine with a temporary KV store
    (`temporary_kv_store`), reads and restores the quick plan's documents, and writes the
    profile with their samples and their fit, the rest of it unchanged; nothing of the store
    or its key stays in the environment."""
    before = {name: os.environ.get(name) for name in ("WIM_KV_STORE", "WIM_KV_MASTER_KEY")}
    base = EngineProfile.load().model_copy(update={"dtype": "float32", "restore": None})
    given, out = tmp_path / "base.json", tmp_path / "profile.json"
    given.write_text(base.model_dump_json())
    # The tests' engine settings, on the own-process engines' core (tests/conftest.py).
    engine = TEST_ENGINE.model_copy(update={"cpu_threads_bind": OWN_ENGINE_CORE})
    flags = shlex.split(" ".join(engine.cli_argv()))
    argv = ["--restore-only", "--quick", "--profile", str(given), "--out", str(out), *flags]
    assert main(["calibrate", *argv]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote the engine profile to {out}"
    assert "restore MARE" in printed[-3]
    profile = EngineProfile.load(out)
    restores = [s for s in profile.samples if isinstance(s, RestoreSample)]
    assert [s.tokens for s in restores] == list(QUICK_RESTORE_TOKENS)
    # Loaded, not computed: at most one block and one token of each document.
    assert all(0 < s.computed <= TEST_ENGINE.block_size + 1 for s in restores)
    assert all(0 < s.seconds < 60 for s in restores)
    assert profile.restore is not None and profile.restore == fit_restore(profile.samples)
    assert profile.model_copy(update={"samples": base.samples, "restore": None}) == base
    assert {name: os.environ.get(name) for name in before} == before
