"""How old the loads a decision rests on may be (`placement.polls.Fresh`): the rule of the
router's `Recent` (its fleet's `fresh_loads`) and of `wim sim`'s asks for the reports."""

from __future__ import annotations

from wim_service.placement.polls import FRESH_LOADS_S, Fresh


def test_nothing_is_fresh_before_it_was_taken() -> None:
    assert not Fresh().holds(0.0)
    assert not Fresh(max_age_s=10.0).holds(-1e9)


def test_what_was_taken_holds_for_max_age_s_inclusive_then_not() -> None:
    fresh = Fresh()
    fresh.took(100.0)
    assert fresh.holds(100.0)
    assert fresh.holds(100.0 + FRESH_LOADS_S)  # exactly that old: still fresh
    assert not fresh.holds(100.0 + FRESH_LOADS_S + 1e-6)
    fresh.took(200.0)  # taken again: fresh from then on
    assert fresh.holds(200.0 + FRESH_LOADS_S) and not fresh.holds(201.0)


def test_a_max_age_of_zero_holds_only_at_the_instant_it_was_taken() -> None:
    fresh = Fresh(max_age_s=0.0)
    fresh.took(5.0)
    assert fresh.holds(5.0) and not fresh.holds(5.000001)
