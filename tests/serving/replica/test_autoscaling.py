"""The engine autoscaling policy: replicas for the requests or for the reserved KV."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from wim_service.serving.replica.autoscaling import (
    KV_RESERVED_FRACTION,
    SESSION_FRACTION,
    KVAwarePolicy,
)


@dataclass
class Config:
    target: float = 4.0

    def get_target_ongoing_requests(self) -> float:
        return self.target


@dataclass
class Context:
    current_num_replicas: int
    total_num_requests: float
    kv: dict[str, float] = field(default_factory=dict)
    target_num_replicas: int = 1
    slots: dict[str, float] = field(default_factory=dict)
    config: Config = field(default_factory=Config)

    @property
    def aggregated_metrics(self) -> dict[str, Any]:
        return {KV_RESERVED_FRACTION: self.kv, SESSION_FRACTION: self.slots}


def test_parked_sessions_scale_up_with_no_request_running() -> None:
    policy = KVAwarePolicy(target_kv_fraction=0.6)
    desired, _ = policy(Context(1, 0, {"a": 0.9}))
    assert desired == pytest.approx(1.5)  # Serve rounds up: a second replica
    assert policy(Context(2, 0, {"a": 0.3, "b": 0.2}))[0] < 1  # half empty: may shrink


def test_full_session_slots_scale_up_with_kv_to_spare() -> None:
    """Three of four session slots taken with little KV reserved: the next sessions would be
    refused for slots, so that replica counts as 75% full."""
    policy = KVAwarePolicy(target_kv_fraction=0.5)
    assert policy(Context(1, 0, {"a": 0.2}, slots={"a": 0.75}))[0] == pytest.approx(1.5)
    assert policy(Context(1, 0, {"a": 0.6}, slots={"a": 0.25}))[0] == pytest.approx(1.2)
    assert policy(Context(2, 0, {"a": 0.1, "b": 0.0}, slots={"a": 0.25, "b": 0.0}))[0] < 1


def test_requests_still_count() -> None:
    policy = KVAwarePolicy()
    assert policy(Context(1, 12, {"a": 0.1}))[0] == 3


def test_no_scale_down_while_requests_run() -> None:
    policy = KVAwarePolicy()
    assert policy(Context(3, 1, {"a": 0.0, "b": 0.0, "c": 0.0}))[0] == 3
    assert policy(Context(3, 0, {"a": 0.0, "b": 0.0, "c": 0.0}))[0] == 0


@dataclass
class Unreported(Context):
    """Replicas that reported no custom metric yet (just started)."""

    @property
    def aggregated_metrics(self) -> dict[str, Any]:
        return {}


def test_replicas_count_by_what_they_reported() -> None:
    """A replica just started reports no fullness yet, or only one of its two fractions."""
    assert KVAwarePolicy()(Unreported(2, 12))[0] == 3  # by the requests alone
    policy = KVAwarePolicy(target_kv_fraction=0.6)
    assert policy(Context(1, 0, slots={"a": 0.3}))[0] == pytest.approx(0.5)


def test_no_replica_keeps_the_target() -> None:
    assert KVAwarePolicy()(Context(0, 5, target_num_replicas=1))[0] == 1
    for outside in (0, 1.5):
        with pytest.raises(ValueError, match=r"^target_kv_fraction must be in \(0, 1\]$"):
            KVAwarePolicy(target_kv_fraction=outside)
    # Every replica full is a valid target (scale only when sessions would be refused).
    assert KVAwarePolicy(target_kv_fraction=1.0)(Context(2, 0, {"a": 1.0, "b": 0.5}))[0] == 1.5
