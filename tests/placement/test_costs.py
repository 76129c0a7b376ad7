"""The engine profile's costs and errors (`placement/profile.py`), the job's cost on a replica
(`policy.job_s`), the round-robin policy's placements and the message of `NoRoom`
(`placement/state.py`), each against figures worked out by hand."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.profile import PROFILE, PROFILE_FIELDS
from wim_service.placement.policy import (
    ExpectedWait,
    RoundRobin,
    first_token_s,
    fits_holder,
    job_s,
)
from wim_service.placement.profile import EngineProfile, ProfileError, RestoreCost
from wim_service.placement.state import NoRoom, PrefixCache, ReplicaState, Work

# -- the profile ----------------------------------------------------------------------------


def test_a_restore_costs_its_fixed_step_and_its_tokens_and_nothing_without_tokens() -> None:
    restore = RestoreCost(fixed_s=0.5, per_token_s=0.25)
    assert restore.seconds(1) == 0.75
    assert restore.seconds(4) == 1.5
    assert restore.seconds(0) == 0.0


def test_a_profile_names_the_dtype_it_was_not_measured_in() -> None:
    assert PROFILE.dtype_mismatch("float32") is None
    assert PROFILE.dtype_mismatch("bfloat16") == (
        "the engine profile was measured in float32, the engines run bfloat16"
    )


def test_a_lone_querys_margins_decode_over_their_mean_context() -> None:
    """3 margins of 5 tokens over a 3,000-token document: 4 steps after the first token, each
    over 3 x (3,000 + 60 prompt + 2.5 mean output) tokens of context."""
    p = PROFILE
    seconds = p.lone_query_seconds(3000, 40, 3, 5)
    answer = p.prefill.seconds(40 + 3 * 5 + 50, cached=3000)
    prompts = p.prefill.seconds(3 * 60, cached=3000)
    decode = 4 * p.decode.step_seconds(3, round(3 * (3000 + 60 + 2.5)))
    assert seconds == pytest.approx(answer + prompts + decode, rel=1e-12)
    assert decode != pytest.approx(4 * p.decode.step_seconds(3, 3 * (3000 + 60)), rel=1e-12)


def _load_error(tmp_path: Path, fields: dict[str, Any]) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ProfileError) as refused:
        EngineProfile.load(path)
    return str(refused.value)


def test_a_bad_profile_is_named_by_its_first_error_and_the_count_of_the_others(
    tmp_path: Path,
) -> None:
    one = _load_error(tmp_path, PROFILE_FIELDS | {"block_tokens": 0})
    assert one == (
        f"profile {tmp_path / 'profile.json'}: block_tokens: Input should be greater than 0, not 0"
    )
    two = _load_error(tmp_path, PROFILE_FIELDS | {"block_tokens": 0, "max_batch": 0})
    assert two.endswith(", not 0 (and 1 more)")
    three = _load_error(tmp_path, PROFILE_FIELDS | {"block_tokens": 0, "max_batch": 0, "model": 1})
    assert three.endswith(" (and 2 more)")


def test_a_long_bad_value_is_cut_short_and_a_bad_whole_profile_is_named(tmp_path: Path) -> None:
    # A repr of exactly 40 characters is shown whole; one of 41 is cut to its first 30.
    forty, forty_one = "x" * 38, "x" * 39
    whole = _load_error(tmp_path, PROFILE_FIELDS | {"version": forty})
    assert whole.endswith(f"not {forty!r}")
    cut = _load_error(tmp_path, PROFILE_FIELDS | {"version": forty_one})
    assert cut.endswith(f"not {repr(forty_one)[:30]}... (41 characters)")
    # Not an object at all: no field to name.
    path = tmp_path / "profile.json"
    path.write_text("[]")
    with pytest.raises(ProfileError, match=r": the profile: .*, not \[\]$"):
        EngineProfile.load(path)


# -- a job's cost on a replica --------------------------------------------------------------


def test_a_jobs_cost_is_its_first_token_then_its_answer_in_the_batch_it_joins() -> None:
    work = Work(prompt_tokens=1000, answer_tokens=20, kv_blocks=40)
    busy = ReplicaState("r", free_blocks=100, free_sessions=1, running=3)
    first = first_token_s(PROFILE, work, busy)
    answer = 20 * PROFILE.decode.step_seconds(3 + 1, 1000 + 20)
    assert job_s(PROFILE, work, busy) == pytest.approx(first + answer, rel=1e-12)


# A query of a 3,000-token document, 40 tokens of its own.
QUERY = Work(
    prompt_tokens=3040, answer_tokens=10, document="a", document_tokens=3000, document_blocks=100
)


def test_a_jobs_cost_charges_a_copys_read_only_when_asked() -> None:
    idle = ReplicaState("r", free_blocks=200, free_sessions=1)
    read = PROFILE.prefill.seconds(3000)
    assert job_s(PROFILE, QUERY, idle, copy=True) == pytest.approx(
        job_s(PROFILE, QUERY, idle) + read
    )


def _prefill_s(new: int, cached: int) -> float:
    """The tests' profile's prefill, written out: 0.02 s, then per new token 0.3 ms and 10 ns
    per token of its mean context."""
    return 0.02 + new * (3e-4 + 1e-8 * (cached + new / 2))


def _margins_s(margins: int, margin_tokens: int, running: int, context: int) -> float:
    """The margins' 60-token prompts prefilled after `context` tokens, then their tokens
    decoded in a batch of `running` + `margins` sequences, each over the whole context."""
    step = 0.02 + (running + margins) * 1e-3 + margins * context * 1e-7
    return _prefill_s(margins * 60, context) + margin_tokens * step


def test_a_wim_querys_first_token_is_its_query_then_its_margins_in_the_batch_they_join() -> None:
    """A query of a 3,000-token document (40 tokens of its own, 3 margins of 5 tokens) on a
    replica running 2 sequences: the query and the 50 early answer tokens prefilled after the
    document, then the margins. On a replica without a copy the document is read first."""
    work = replace(QUERY, margins=3, margin_tokens=5)
    busy = ReplicaState("r", free_blocks=200, free_sessions=1, running=2)
    held = _prefill_s(40 + 50, 3000) + _margins_s(3, 5, 2, 3000)
    assert first_token_s(PROFILE, work, busy) == pytest.approx(held, rel=1e-12)
    copied = first_token_s(PROFILE, work, busy, copy=True)
    assert copied == pytest.approx(_prefill_s(3000, 0) + held, rel=1e-12)


def test_a_one_shot_jobs_first_token_prefills_what_the_replica_does_not_cache() -> None:
    """A one-shot WiM job of 2,000 prompt tokens whose first 512-token block the replica
    caches: the other 1,488 and the 50 early answer tokens prefilled after it, then its 2
    margins of 4 tokens over the whole prompt."""
    work = Work(prompt_tokens=2000, answer_tokens=10, prefix=(7, 8), margins=2, margin_tokens=4)
    cache = PrefixCache(4)
    cache.insert((7,))
    replica = ReplicaState("r", free_blocks=200, free_sessions=1, running=1, prefix_cache=cache)
    expected = _prefill_s(1488 + 50, 512) + _margins_s(2, 4, 1, 2000)
    assert first_token_s(PROFILE, work, replica) == pytest.approx(expected, rel=1e-12)


def test_a_plain_request_is_charged_five_times_the_prefill_its_replica_does_not_cache() -> None:
    """Expected wait's cost of a plain request: its wait for the first token, plus
    `RECOMPUTE_CHARGE` (5) times the prefill of the 1,488 tokens this replica does not
    cache after its 512."""
    work = Work(prompt_tokens=2000, answer_tokens=10, kv_blocks=70, prefix=(7, 8))
    cache = PrefixCache(4)
    cache.insert((7,))
    replica = ReplicaState("r", free_blocks=200, free_sessions=1, backlog_s=3.0, prefix_cache=cache)
    policy = ExpectedWait(PROFILE)
    recompute = _prefill_s(1488, 512)
    assert policy.start_s(work, replica, copy=False) == pytest.approx(3.0 + recompute, rel=1e-12)
    cost = policy.cost_s(work, replica, copy=False)
    assert cost == pytest.approx(3.0 + recompute + 5 * recompute, rel=1e-12)


def test_a_holder_with_exactly_the_jobs_blocks_free_takes_it() -> None:
    work = Work(prompt_tokens=3040, answer_tokens=10, kv_blocks=40, document="a")
    assert fits_holder(work, ReplicaState("r", free_blocks=40, free_sessions=0))
    assert not fits_holder(work, ReplicaState("r", free_blocks=39, free_sessions=0))


# -- round robin ----------------------------------------------------------------------------


def _replica(name: str, **fields: Any) -> ReplicaState:
    return ReplicaState(name, free_blocks=fields.pop("free_blocks", 500), free_sessions=2, **fields)


def test_round_robin_takes_the_replicas_in_turn_and_reads_a_copy_where_none_is() -> None:
    query = Work(
        prompt_tokens=3040,
        answer_tokens=10,
        document="a",
        document_tokens=3000,
        document_blocks=100,
    )
    replicas = [_replica("b", documents=frozenset({"a"})), _replica("a")]
    policy = RoundRobin()
    first, second, third = (policy.place(query, replicas) for _ in range(3))
    # By name: "a" first (no copy there: it opens one, nothing cached), then "b" (its copy).
    assert (first.replica, first.open_copy, first.cached_tokens) == ("a", True, 0)
    assert (second.replica, second.open_copy, second.cached_tokens) == ("b", False, 3000)
    assert third.replica == "a"


def test_round_robin_reports_the_prefix_a_plain_job_finds_cached() -> None:
    cache = PrefixCache(100)
    cache.insert((1, 2, 3))
    plain = Work(prompt_tokens=2048, answer_tokens=8, kv_blocks=10, prefix=(1, 2, 9))
    placement = RoundRobin().place(plain, [_replica("a", prefix_cache=cache)])
    assert (placement.replica, placement.open_copy, placement.cached_tokens) == ("a", False, 1024)


def test_no_room_names_the_blocks_a_new_copy_needs_and_the_live_replicas() -> None:
    query = Work(
        prompt_tokens=3040, answer_tokens=10, kv_blocks=7, document="a", document_blocks=90
    )
    with pytest.raises(NoRoom) as refused:
        RoundRobin().place(query, [_replica("a", free_blocks=50), _replica("b", free_blocks=96)])
    assert str(refused.value) == "no engine replica has room for 97 KV blocks (2 live)"
    assert refused.value.replicas == 2
