"""The placement policies on hand-made replica states (`wim_service/placement/`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wim_service.placement.policy import (
    DEFAULT_MAX_COPIES,
    RECOMPUTE_CHARGE,
    ExpectedWait,
    RoundRobin,
    Sticky,
    make_policy,
)
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, PrefixCache, ReplicaState, Work

PROFILE = EngineProfile.load()


def replicas(*backlogs: float, free: int = 1000) -> list[ReplicaState]:
    return [
        ReplicaState(
            f"r{i}", free_blocks=free, free_sessions=4, backlog_s=b, prefix_cache=PrefixCache(100)
        )
        for i, b in enumerate(backlogs)
    ]


def test_the_shipped_profile_loads_and_costs_grow_with_tokens() -> None:
    assert PROFILE.prefill.seconds(2000) > PROFILE.prefill.seconds(1000) > 0
    assert PROFILE.prefill.seconds(0) == 0
    assert PROFILE.decode.step_seconds(8, 10_000) > PROFILE.decode.step_seconds(1, 1000)


def test_prefix_cache_matches_leading_blocks_and_evicts_tails_first() -> None:
    """Past capacity the least recently used block leaves, and of one prompt its tail before
    its head, as vLLM frees a request's blocks: what stays of a prompt is still a prefix."""
    cache = PrefixCache(4)
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 9, 3]) == 2
    cache.insert([7, 8])  # 5 blocks > 4: the older prompt's tail, block 3, leaves
    assert cache.match([1, 2, 3]) == 2 and cache.match([7, 8]) == 2
    cache.insert([1])  # used again: the most recent block now
    cache.insert([5, 6])  # two more leave: block 2, then [7, 8]'s tail
    assert cache.match([1, 2]) == 1 and cache.match([7, 8]) == 1 and len(cache) == 4


def test_prefix_cache_tells_what_a_prompt_would_evict() -> None:
    """Nothing while the prompt's new blocks fit; else the touch that last used the first
    other block it would evict, one sequence across caches: the lower, the longer ago it was
    used. The prompt's own cached blocks are touched, not evicted."""
    older, newer = PrefixCache(4), PrefixCache(4)
    older.insert([1, 2, 3])
    newer.insert([5, 6, 7])
    assert older.eviction([1, 2, 3, 4]) == (False, 0)
    assert older.eviction([8, 9])[0] and newer.eviction([8, 9])[0]
    assert older.eviction([8, 9]) < newer.eviction([8, 9])
    two = PrefixCache(2)
    two.insert([1])
    two.insert([2])
    assert two.eviction([3]) < two.eviction([1, 3])  # [1, 3] keeps block 1 and evicts 2
    assert two.eviction([1, 2, 3]) == (False, 0)  # only its own blocks would leave


def test_expected_wait_sends_a_cold_prompt_where_the_fleets_oldest_blocks_go() -> None:
    """Between replicas alike in cost and free KV, a prompt no replica caches goes where
    caching it evicts nothing, else where the block it evicts was used longest ago: the
    fleet's caches evict as one LRU cache would, not the first replica's by name."""
    fleet = replicas(0.0, 0.0, 0.0)
    for replica, prompt in zip(fleet, ((), range(100, 200), range(200, 300)), strict=True):
        replica.prefix_cache.insert(prompt)  # type: ignore[union-attr]
    cold = Work(prompt_tokens=8192, answer_tokens=4, prefix=tuple(range(1000, 1016)))
    policy = ExpectedWait(PROFILE)
    assert policy.place(cold, fleet).replica == "r0"  # its cache has room: nothing evicted
    fleet[0].prefix_cache.insert(range(300, 400))  # type: ignore[union-attr]
    assert policy.place(cold, fleet).replica == "r1"  # its blocks were used longest ago
    fleet[1].prefix_cache.insert(range(400, 500))  # type: ignore[union-attr]
    assert policy.place(cold, fleet).replica == "r2"


def test_expected_wait_prefers_a_cached_prefix_unless_its_replica_is_busier() -> None:
    work = Work(prompt_tokens=4096, answer_tokens=16, prefix=tuple(range(8)))
    fleet = replicas(0.0, 0.0)
    fleet[1].prefix_cache.insert(range(8))  # type: ignore[union-attr]
    policy = ExpectedWait(PROFILE)
    chosen = policy.place(work, fleet)
    assert (chosen.replica, chosen.cached_tokens) == ("r1", 4096)
    # Busier than recomputing the whole prompt elsewhere, but not by (1 + RECOMPUTE_CHARGE)
    # times that: it stays (a recompute delays what queues behind it on the other replica and
    # caches the prefix twice, evicting other prompts' blocks).
    recompute = PROFILE.prefill.seconds(4096)
    fleet[1].backlog_s = RECOMPUTE_CHARGE * recompute
    stay = policy.place(work, fleet)
    assert (stay.replica, stay.expected_wait_s) == (
        "r1",
        pytest.approx(RECOMPUTE_CHARGE * recompute, abs=1),
    )
    # Busier by more than that: the idle replica wins.
    fleet[1].backlog_s = (1 + RECOMPUTE_CHARGE) * recompute + 1.0
    assert policy.place(work, fleet).replica == "r0"


def test_expected_wait_opens_a_copy_of_a_hot_document_only_when_it_is_quicker() -> None:
    work = Work(
        prompt_tokens=3100, answer_tokens=16, document="d", document_tokens=3000, document_blocks=94
    )
    fleet = replicas(0.0, 0.0)
    fleet[0].documents = frozenset({"d"})
    policy = ExpectedWait(PROFILE)
    assert policy.place(work, fleet) == policy.place(work, fleet)
    stay = policy.place(work, fleet)
    assert (stay.replica, stay.open_copy) == ("r0", False)
    fleet[0].backlog_s = PROFILE.prefill.seconds(3000) * 2
    copy = policy.place(work, fleet)
    assert (copy.replica, copy.open_copy) == ("r1", True)
    # At its copy limit a document stays where its copies are.
    assert ExpectedWait(PROFILE, max_copies=1).place(work, fleet).replica == "r0"


def test_float_residue_in_a_backlog_does_not_break_a_tie() -> None:
    # r0 has run work: its backlog summed and subtracted back to a hair below zero. A new
    # session still goes to the replica with the most free KV, as between idle replicas.
    fleet = replicas(-1e-15, 0.0)
    fleet[0].free_blocks, fleet[0].documents = 800, frozenset({"other"})
    read = Work(prompt_tokens=3000, answer_tokens=0, document="d", document_tokens=3000)
    assert ExpectedWait(PROFILE).place(read, fleet).replica == "r1"


def test_sticky_keeps_a_document_home_and_places_new_work_by_prefix_then_room() -> None:
    fleet = replicas(0.0, 50.0, free=1000)
    fleet[1].documents = frozenset({"d"})
    doc = Work(prompt_tokens=3100, answer_tokens=16, document="d", document_tokens=3000)
    assert Sticky().place(doc, fleet).replica == "r1"
    fleet[0].free_blocks = 2000
    assert Sticky().place(Work(prompt_tokens=100, answer_tokens=4), fleet).replica == "r0"
    fleet[1].prefix_cache.insert([5])  # type: ignore[union-attr]
    assert (
        Sticky().place(Work(prompt_tokens=600, answer_tokens=4, prefix=(5,)), fleet).replica == "r1"
    )


def test_round_robin_cycles_and_reads_copies_where_it_lands() -> None:
    fleet = replicas(0.0, 0.0, 0.0)
    fleet[0].documents = frozenset({"d"})
    policy = RoundRobin()
    doc = Work(prompt_tokens=3100, answer_tokens=16, document="d", document_tokens=3000)
    chosen = [policy.place(doc, fleet) for _ in range(4)]
    assert [p.replica for p in chosen] == ["r0", "r1", "r2", "r0"]
    assert [p.open_copy for p in chosen] == [False, True, True, False]


@pytest.mark.parametrize("name", ["round_robin", "sticky", "wim"])
def test_every_policy_refuses_when_nothing_has_room(name: str) -> None:
    fleet = replicas(0.0, 0.0, free=10)
    fleet[1].draining = True
    with pytest.raises(NoRoom):
        make_policy(name, PROFILE).place(
            Work(prompt_tokens=100, answer_tokens=4, kv_blocks=20), fleet
        )


@pytest.mark.parametrize("name", ["round_robin", "sticky", "wim"])
def test_a_plain_request_needs_kv_but_no_session_slot(name: str) -> None:
    # The engine admits a plain request by its KV alone (`KVAdmission.acquire(session=False)`):
    # a replica whose session slots are all held still takes it, but not a WiM job.
    fleet = replicas(0.0)
    fleet[0].free_sessions = 0
    policy = make_policy(name, PROFILE)
    plain = Work(prompt_tokens=100, answer_tokens=4, kv_blocks=20, takes_session=False)
    assert policy.place(plain, fleet).replica == "r0"
    with pytest.raises(NoRoom):
        policy.place(Work(prompt_tokens=100, answer_tokens=4, kv_blocks=20), fleet)
    fleet[0].free_blocks = 19
    with pytest.raises(NoRoom):
        policy.place(plain, fleet)


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown placement policy 'x'"):
        make_policy("x", PROFILE)


def test_the_router_config_refuses_a_cost_profile_it_cannot_read(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from wim_service.serving.config import RouterConfig

    with pytest.raises(ValidationError, match="is not a readable profile"):
        RouterConfig(cost_profile=str(tmp_path / "missing.json"))
    measured = tmp_path / "measured.json"
    measured.write_text(PROFILE.model_dump_json())
    assert RouterConfig(cost_profile=str(measured)).cost_profile == str(measured)
    assert RouterConfig().placement == "expected_wait"
    assert RouterConfig().max_copies == DEFAULT_MAX_COPIES
