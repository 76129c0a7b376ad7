"""`wim bench`'s 95% interval over rounds: Student's t on known inputs."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from wim_service.benchmarks.intervals import RoundsInterval, t_critical, t_interval


def test_t_critical_matches_the_tables() -> None:
    assert t_critical(1) == 12.706
    assert t_critical(2) == 4.303
    assert t_critical(7) == 2.365
    assert t_critical(30) == 2.042
    # Past the table: the expansion, against the exact values 2.0395 (31), 2.0003 (60),
    # 1.9840 (100) and the normal 1.9600 (infinite).
    assert t_critical(31) == pytest.approx(2.0395, abs=1e-4)
    assert t_critical(60) == pytest.approx(2.0003, abs=1e-4)
    assert t_critical(100) == pytest.approx(1.9840, abs=1e-4)
    assert t_critical(10**9) == pytest.approx(1.9600, abs=1e-4)
    assert all(t_critical(df) > t_critical(df + 1) for df in range(1, 200))
    with pytest.raises(ValueError):
        t_critical(0)


def test_t_interval_on_known_values() -> None:
    # Mean 2, sample standard deviation 1: half-width 4.303 / sqrt(3).
    three = t_interval([1.0, 2.0, 3.0])
    assert three.mean == 2.0 and three.rounds == 3
    assert three.high - three.mean == pytest.approx(4.303 / math.sqrt(3))
    assert three.mean - three.low == pytest.approx(4.303 / math.sqrt(3))
    # Mean 5, standard deviation sqrt(32 / 7): half-width 2.365 * 2.1381 / sqrt(8) = 1.7878.
    eight = t_interval([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert (eight.mean, eight.rounds) == (5.0, 8)
    assert (eight.low, eight.high) == pytest.approx((3.2122, 6.7878), abs=1e-4)


def test_identical_rounds_have_no_spread_and_one_round_no_interval() -> None:
    assert t_interval([1.15] * 4) == pytest.approx(RoundsInterval(1.15, 1.15, 1.15, 4))
    one = t_interval([1.3])
    assert (one.mean, one.low, one.high) == (1.3, None, None)
    assert json.loads(json.dumps(asdict(one), allow_nan=False))["low"] is None
    assert str(one) == "1.300 (1 round: no interval)"
    with pytest.raises(ValueError):
        t_interval([])


def test_the_printed_interval_says_what_it_is() -> None:
    printed = str(t_interval([1.0, 2.0, 3.0]))
    assert printed == "2.000 ± 2.484 [-0.484, 4.484] (95% t-interval, 3 rounds)"
