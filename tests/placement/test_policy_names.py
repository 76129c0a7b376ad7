"""The placement policies' names: expected wait is `expected_wait`; `wim`, its old name, is
still taken (the router's config, `wim sim --policies`, the live comparison) and logged as
deprecated once per process."""

from __future__ import annotations

import logging

import pytest

from wim_service.cli.sim import parse_policies
from wim_service.placement import policy
from wim_service.placement.policy import POLICIES, ExpectedWait, make_policy
from wim_service.placement.profile import EngineProfile
from wim_service.serving.config import RouterConfig

LOGGER = "wim_service.placement.policy"


@pytest.fixture
def deprecations(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """The policy module's log, as in a process that has not used an old name yet."""
    monkeypatch.setattr(policy, "_warned", set())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    return caplog


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_expected_wait_is_the_default_under_its_own_name(
    deprecations: pytest.LogCaptureFixture,
) -> None:
    assert RouterConfig().placement == "expected_wait"
    assert "expected_wait" in POLICIES and "wim" not in POLICIES
    chosen = make_policy("expected_wait", EngineProfile.load())
    assert isinstance(chosen, ExpectedWait) and chosen.name == "expected_wait"
    assert lines(deprecations) == []


def test_the_old_name_wim_means_expected_wait_and_is_logged_once(
    deprecations: pytest.LogCaptureFixture,
) -> None:
    assert RouterConfig(placement="wim").placement == "expected_wait"
    assert RouterConfig.model_validate({"placement": "wim"}).placement == "expected_wait"
    chosen = make_policy("wim", EngineProfile.load())
    assert isinstance(chosen, ExpectedWait) and chosen.name == "expected_wait"
    assert parse_policies("sticky,wim") == ["sticky", "expected_wait"]
    assert lines(deprecations) == [
        "placement policy 'wim' is deprecated: it is called 'expected_wait' now"
    ]


def test_an_unknown_policy_is_still_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement policy 'fastest'"):
        make_policy("fastest", EngineProfile.load())
    with pytest.raises(ValueError, match="unknown placement policy 'fastest'"):
        parse_policies("sticky,fastest")
