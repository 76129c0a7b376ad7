"""What a copy of a document costs when the service restores its KV (`EngineProfile.restore`,
docs/kv-store.md): the policy, the router's booking, the replicas' backlogs and `wim sim`
charge a restore instead of a re-read, the calibration fits it, and the profile bounds it. No
engine: a restore-only calibration on a real one is `tests/cli/test_calibrate.py`'s."""

from __future__ import annotations

import base64
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from tests.fakes.replicas import FakeReplica
from tests.fakes.router import make_service
from tests.sim.test_sim import PROFILE as SIM_PROFILE
from tests.sim.test_sim import doc_row, document_trace
from wim_service.cli import main
from wim_service.engine.calibration.fit import fit_errors, fit_restore, predicted, refit
from wim_service.placement.backlog import Backlog
from wim_service.placement.policy import ExpectedWait, first_token_s
from wim_service.placement.profile import EngineProfile, RestoreCost, RestoreSample, Sample
from wim_service.placement.state import ReplicaState, Work
from wim_service.serving.replica.work import session_work
from wim_service.sim.replay import simulate
from wim_service.sim.settings import SimSettings
from wim_service.wim.options import WiMOptions

RESTORE_COST = RestoreCost(fixed_s=0.05, per_token_s=6e-5)
PROFILE = EngineProfile.load().model_copy(update={"restore": RESTORE_COST})
TOKENS = 4096


def query(document: str = "d") -> Work:
    return session_work(document, TOKENS, 140, WiMOptions(), query="Why?", segments=4)


def idle(name: str, backlog_s: float = 0.0, *documents: str) -> ReplicaState:
    return ReplicaState(
        name,
        free_blocks=10_000,
        free_sessions=4,
        backlog_s=backlog_s,
        documents=frozenset(documents),
    )


# -- the charge -----------------------------------------------------------------------------


def test_a_copy_of_a_document_read_before_is_charged_its_restore_not_its_prefill() -> None:
    work = query()
    copied = first_token_s(PROFILE, work, idle("r"), copy=True)
    held = first_token_s(PROFILE, work, idle("r"), copy=False)
    assert copied - held == pytest.approx(RESTORE_COST.seconds(TOKENS))
    assert RESTORE_COST.seconds(TOKENS) < PROFILE.prefill.seconds(TOKENS) / 10
    # Without a KV store (or told not to count on it) the copy re-reads the document.
    no_store = first_token_s(PROFILE.for_store(False), work, idle("r"), copy=True)
    assert no_store - held == pytest.approx(PROFILE.prefill.seconds(TOKENS))


def test_a_first_read_is_a_prefill_and_a_rebuild_a_restore() -> None:
    fresh = session_work("d", TOKENS, 140, WiMOptions())
    rebuild = session_work("d", TOKENS, 140, WiMOptions(), restorable=True)
    assert first_token_s(PROFILE, fresh, idle("r"), copy=True) == pytest.approx(
        PROFILE.prefill.seconds(TOKENS)
    )
    assert first_token_s(PROFILE, rebuild, idle("r"), copy=True) == pytest.approx(
        RESTORE_COST.seconds(TOKENS)
    )


def test_expected_wait_copies_a_hot_document_once_a_restore_is_quicker_than_waiting() -> None:
    """A holder busy for longer than a restore but not a re-read: with a KV store the next
    query opens a copy on the idle replica; without one it waits for the holder."""
    busy = (RESTORE_COST.seconds(TOKENS) + PROFILE.prefill.seconds(TOKENS)) / 2
    fleet = [idle("r0", busy, "d"), idle("r1")]
    restoring = ExpectedWait(PROFILE).place(query(), fleet)
    assert (restoring.replica, restoring.open_copy) == ("r1", True)
    re_reading = ExpectedWait(PROFILE.for_store(False)).place(query(), fleet)
    assert (re_reading.replica, re_reading.open_copy) == ("r0", False)


def test_a_replicas_backlog_books_a_restore_for_a_copy_it_restores() -> None:
    rebuild = session_work("d", TOKENS, 0, WiMOptions(), restorable=True)
    with Backlog(PROFILE).job(rebuild, copy=True) as restored:
        pass
    with Backlog(PROFILE.for_store(False)).job(rebuild, copy=True) as read:
        pass
    assert restored == pytest.approx(RESTORE_COST.seconds(TOKENS))
    assert read == pytest.approx(PROFILE.prefill.seconds(TOKENS))


@pytest.fixture
def kv_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WIM_KV_STORE", str(tmp_path / "kv"))
    monkeypatch.setenv("WIM_KV_MASTER_KEY", base64.b64encode(os.urandom(32)).decode())


@pytest.mark.parametrize(("store", "setting", "restores"), [
    (True, None, True), (False, None, False), (True, False, False), (False, True, True)
])  # fmt: skip
def test_the_router_charges_restores_when_its_service_has_a_kv_store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    store: bool,
    setting: bool | None,
    restores: bool,
) -> None:
    if store:
        request.getfixturevalue("kv_env")
    path = tmp_path / "profile.json"
    path.write_text(PROFILE.model_dump_json())
    router_config: dict[str, object] = {"cost_profile": str(path)}
    if setting is not None:
        router_config["restore_copies"] = setting
    _, router = make_service(FakeReplica("a"), **router_config)
    ledger = router.fleet.ledger
    assert (ledger.profile.restore is not None) == restores
    assert ledger.profile == ledger.policy.profile  # type: ignore[attr-defined]


# -- wim sim --------------------------------------------------------------------------------


def test_the_simulator_charges_a_copy_what_the_policy_does(tmp_path: Path) -> None:
    # Round robin: the session's read on r0; its first query on r1, reading a copy there
    # first; its second on r0, the session's own copy (test_sim's placement).
    profile = SIM_PROFILE.model_copy(update={"restore": RESTORE_COST})
    trace = document_trace([doc_row(0.0, "a", wim=True), doc_row(0.1, "a", wim=True)], tmp_path)
    runs = [
        simulate(trace, "round_robin", 2, profile, SimSettings(restore_copies=restores))
        for restores in (True, False)
    ]
    (copied, held), (re_read, held_too) = (sorted(r.outcomes, key=lambda o: o.index) for r in runs)
    assert (copied.replica, held.replica) == (re_read.replica, held_too.replica) == (1, 0)
    saved = profile.prefill.seconds(3000) - RESTORE_COST.seconds(3000)
    assert re_read.first_token_s - copied.first_token_s == pytest.approx(saved)
    # The session's first read and a query on the copy it made are charged alike.
    assert held.first_token_s == pytest.approx(held_too.first_token_s)


def test_the_command_says_how_copies_are_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, profile = tmp_path / "docs.jsonl", tmp_path / "profile.json"
    profile.write_text(SIM_PROFILE.model_copy(update={"restore": RESTORE_COST}).model_dump_json())
    assert main(["sim", "--generate", str(trace), "--requests", "10"]) == 0
    argv = ["sim", "--trace", str(trace), "--replicas", "2", "--profile", str(profile)]
    assert main(argv) == 0
    assert "copies restore their document's KV" in capsys.readouterr().err
    assert main([*argv, "--no-restore-copies"]) == 0
    assert "copies re-read their document (--no-restore-copies)" in capsys.readouterr().err


# -- the profile ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default.json", "one-core.json"])
def test_both_shipped_profiles_carry_a_measured_restore_cost(name: str) -> None:
    path = resources.files("wim_service.placement").joinpath("profiles", name)
    profile = EngineProfile.load(Path(str(path)))
    assert profile.restore is not None
    restores = [s for s in profile.samples if isinstance(s, RestoreSample)]
    assert {s.tokens for s in restores} >= {1024, 2048, 4096}
    assert profile.restore == fit_restore(profile.samples)
    # Measured: a restore of 4,096 tokens is a fraction of their re-read.
    assert profile.read_seconds(4096, saved=True) < profile.prefill.seconds(4096) / 5


@pytest.mark.parametrize(
    ("restore", "accepted"),
    [
        ({"fixed_s": 0.0, "per_token_s": 0.0}, True),
        ({"fixed_s": 600, "per_token_s": 60}, True),
        ({"fixed_s": -0.1, "per_token_s": 1e-5}, False),
        ({"fixed_s": 0.1, "per_token_s": 61}, False),
        ({"fixed_s": float("inf"), "per_token_s": 1e-5}, False),
        ({"fixed_s": 0.1}, False),
        ({"fixed_s": 0.1, "per_token_s": 1e-5, "per_block_s": 1}, False),
    ],
)
def test_the_restore_cost_is_bounded_as_the_others(restore: dict, accepted: bool) -> None:
    data = json.loads(PROFILE.model_dump_json()) | {"restore": restore}
    if accepted:
        assert EngineProfile.model_validate(data).restore == RestoreCost(**restore)
    else:
        with pytest.raises(ValidationError):
            EngineProfile.model_validate(data)


def test_a_profile_without_a_restore_cost_loads_and_charges_re_reads() -> None:
    data = json.loads(PROFILE.model_dump_json())
    del data["restore"]
    old = EngineProfile.model_validate(data)
    assert old.restore is None
    assert old.read_seconds(TOKENS, saved=True) == old.prefill.seconds(TOKENS)


# -- calibration ----------------------------------------------------------------------------


def restore_samples(noise: float = 0.0) -> list[Sample]:
    rng = np.random.default_rng(3)
    return [
        RestoreSample(
            tokens=tokens,
            computed=32,
            seconds=RESTORE_COST.seconds(tokens) * (1 + noise * rng.standard_normal()),
            unix_time=0.0,
            load_1min=0.0,
        )
        for tokens in (1024, 2048, 4096, 1024, 2048, 4096)
    ]


def test_the_restore_fit_recovers_its_costs_and_reports_its_error() -> None:
    fitted = fit_restore(restore_samples())
    assert fitted is not None
    assert fitted.model_dump() == pytest.approx(RESTORE_COST.model_dump(), rel=1e-6)
    noisy = fit_restore(restore_samples(0.03))
    assert noisy is not None and noisy.per_token_s == pytest.approx(6e-5, rel=0.15)
    others = [s for s in PROFILE.samples if not isinstance(s, RestoreSample)]
    samples = others + restore_samples()
    profile = refit(PROFILE.model_copy(update={"samples": samples, "restore": None}))
    assert profile.restore is not None
    assert profile.restore.model_dump() == pytest.approx(RESTORE_COST.model_dump(), rel=1e-6)
    assert fit_errors(profile)["restore"] == pytest.approx(0.0, abs=1e-9)
    assert predicted(profile, samples[-1]) == pytest.approx(samples[-1].seconds)
    # No restore samples: nothing to fit, and a refit keeps the profile's own.
    assert fit_restore(others) is None
    assert refit(PROFILE.model_copy(update={"samples": others})).restore == RESTORE_COST
