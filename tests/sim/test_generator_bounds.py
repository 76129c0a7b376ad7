"""`wim sim --generate`'s options at their bounds (`sim/generate.py`): the smallest and largest
value each takes, the first one past it refused with the option's name and its bounds, and a
generated trace refused as a whole exactly where `read_trace` would refuse it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from wim_service.sim.generate import GeneratorOptions, check_readable
from wim_service.sim.traces import DOCUMENT_BLOCK_TOKENS, MAX_ARRIVAL_S, MAX_TRACE_BLOCKS

SEED_MOST = 2**63 - 1


@pytest.mark.parametrize(
    ("field", "least"),
    [
        ("requests", 1),
        ("documents", 1),
        ("queries_per_session", 1),
        ("query_tokens", 1),
        ("answer_tokens", 1),
        ("seed", 0),
    ],
)
def test_each_count_takes_its_least_value_and_refuses_one_below(field: str, least: int) -> None:
    replace(GeneratorOptions(), **{field: least}).check()
    with pytest.raises(ValueError) as refused:
        replace(GeneratorOptions(), **{field: least - 1}).check()
    assert str(refused.value).startswith(f"{field} must be within {least:,}-")
    assert str(refused.value).endswith(f", not {least - 1:,}")


def test_the_shortest_documents_are_one_token() -> None:
    GeneratorOptions(document_tokens=(1, 1)).check()
    with pytest.raises(
        ValueError, match=r"^document_tokens LOW must be within 1-1,000,000, not 0$"
    ):
        GeneratorOptions(document_tokens=(0, 1)).check()


def test_the_largest_seed_and_rate_are_taken_and_one_past_them_refused() -> None:
    GeneratorOptions(seed=SEED_MOST).check()
    with pytest.raises(ValueError) as refused:
        GeneratorOptions(seed=SEED_MOST + 1).check()
    assert str(refused.value).startswith("seed must be within 0-")
    GeneratorOptions(rate=1e6).check()
    with pytest.raises(ValueError, match=r"^rate must be within 0.001-1e\+06, not 1e\+06$"):
        GeneratorOptions(rate=1e6 + 0.5).check()


def row(document_tokens: int, *, wim: bool, at: float = 0.0, **fields: Any) -> dict[str, Any]:
    return {"timestamp_s": at, "document_tokens": document_tokens, "wim": wim} | fields


def test_only_the_last_arrival_is_held_to_the_trace_s_length() -> None:
    rows = [row(64, wim=False, at=t) for t in (0.0, 1.0, MAX_ARRIVAL_S)]
    check_readable(rows)  # arriving exactly at the bound is within it
    rows.append(row(64, wim=False, at=MAX_ARRIVAL_S + 1))
    with pytest.raises(ValueError, match="would last beyond"):
        check_readable(rows)


# A plain row counts its whole blocks of prefix hashes; a WiM row its margins (given, else one
# per smallest segment).
FULL = DOCUMENT_BLOCK_TOKENS * MAX_TRACE_BLOCKS + DOCUMENT_BLOCK_TOKENS - 1


def test_a_trace_holds_at_most_its_bound_of_prefix_hashes_and_margins() -> None:
    check_readable([row(FULL, wim=False)])  # exactly MAX_TRACE_BLOCKS whole blocks
    check_readable([row(FULL, wim=False), row(64, wim=True, margins=0)])
    with pytest.raises(ValueError, match=f"would hold {MAX_TRACE_BLOCKS + 1:,} prefix hashes"):
        check_readable([row(FULL, wim=False), row(64, wim=True, margins=1)])
    with pytest.raises(ValueError, match=f"would hold {MAX_TRACE_BLOCKS + 2:,} prefix hashes"):
        check_readable([row(FULL, wim=False), row(64, wim=True)])  # a margin per 32 tokens
    with pytest.raises(ValueError, match=f"would hold {MAX_TRACE_BLOCKS + 1:,} prefix hashes"):
        check_readable([row(FULL, wim=False), row(DOCUMENT_BLOCK_TOKENS, wim=False)])
