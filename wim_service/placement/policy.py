"""The placement policies: round robin, sticky (the service's behaviour before expected
wait, kept for comparison) and expected wait (the default).

Each policy answers where one job runs, given every replica's state; the caller then books
the job on that replica (its KV, its session slot, its backlog) before it places the next.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Placement, ReplicaState, Work

logger = logging.getLogger(__name__)

# Replicas one document may be held on at once, its first read included: as many as the
# router takes (`RouterConfig.max_copies`). A hot document's copies are its parallelism, and
# the policy opens one only where it is quicker than waiting at a holder, so a lower cap only
# queues a hot document's queries at its holders while other replicas have room: with 8, a
# document taking half of a trace's queries saturated its 8 holders at 32 and 64 replicas,
# where round robin, copying it everywhere, answered sooner (docs/routing.md). A copy's cost
# in room is bounded otherwise: an idle copy is retired, a spare one reclaimed for new work.
DEFAULT_MAX_COPIES = 64
# What leaving a cached prefix costs a request without a document, in units of the prefill it
# then does that the prefix holder would not: charged this many times over its own wait.
# Besides delaying what queues behind it, the recompute caches the prefix a second time,
# evicting other prompts' blocks, so the next request of that prefix finds less; the prefix
# holder is left only for one less busy by more than (1 + this) times the recompute. With
# 1, `wim sim` of generated document traces reused prefixes less than `sticky`. With 10 and
# more, requests of Mooncake's trace queued behind busy prefix holders where KV was plenty
# (400,000 tokens per replica), while 2 to 8 moved them and lowered p95 by 3-4%; elsewhere
# 5 and 10 place alike or within a replay's own spread (the runs: docs/routing.md).
RECOMPUTE_CHARGE = 5


class PlacementPolicy(Protocol):
    name: str
    # Whether the replicas' loads change its answer: only then is a placement worth making
    # again on fresher loads (`serving/routing/copies.py`).
    weighs_loads: bool

    def place(self, work: Work, replicas: Sequence[ReplicaState]) -> Placement:
        """Where `work` runs; raises `NoRoom` when no replica can take it."""
        ...


def holders(work: Work, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas holding a copy of the job's document (none for other jobs)."""
    if work.document is None:
        return []
    return [r for r in replicas if work.document in r.documents and not r.draining]


def with_room(work: Work, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas that could take the job on a fresh copy: room for the document (if any)
    and the job in KV, and a free session slot if it takes one."""
    need = work.kv_blocks + work.document_blocks
    return [
        r
        for r in replicas
        if not r.draining
        and r.free_blocks >= need
        and (r.free_sessions > 0 or not work.takes_session)
    ]


def fits_holder(work: Work, replica: ReplicaState) -> bool:
    """Whether a replica holding the job's document has room for the job itself."""
    return replica.free_blocks >= work.kv_blocks


def first_token_s(
    profile: EngineProfile, work: Work, replica: ReplicaState, *, copy: bool = False
) -> float:
    """Seconds of engine work before the job's first answer token on `replica`, with nothing
    queued ahead of it: the prefill still to do (the tokens not already in its cache; on a
    replica without a copy, `copy`, the document's read or restore), then the job's margins."""
    p = profile
    extra = p.query_extra_tokens if work.margins else 0  # the answers started early
    if work.document is not None:
        read = p.read_seconds(work.document_tokens, saved=work.restorable) if copy else 0.0
        query = work.prompt_tokens - work.document_tokens
        prefill = read + p.prefill.seconds(query + extra, cached=work.document_tokens)
        context = work.document_tokens
    else:
        cached = replica.cached_tokens(work)
        prefill = p.prefill.seconds(work.prompt_tokens - cached + extra, cached=cached)
        context = work.prompt_tokens
    margins = 0.0
    if work.margins:
        margins = p.prefill.seconds(work.margins * p.margin_prompt_tokens, cached=context)
        batch = replica.running + work.margins
        margins += p.decode_seconds(work.margin_tokens, batch, context * work.margins)
    return prefill + margins


def job_s(
    profile: EngineProfile, work: Work, replica: ReplicaState, *, copy: bool = False
) -> float:
    """Seconds of engine work the whole job is expected to take on `replica` (its first token,
    then its answer decoded in a batch with what runs there): what a replica books as its
    backlog when the job starts, and what the router books between two load reports."""
    answer = profile.decode_seconds(
        work.answer_tokens, replica.running + 1, work.prompt_tokens + work.answer_tokens
    )
    return first_token_s(profile, work, replica, copy=copy) + answer


@dataclass
class ExpectedWait:
    """Send each job where it is expected to finish its first token soonest: the work queued
    ahead of it, plus the prefill that replica would still have to do (the tokens not already
    in its cache; a whole document on a replica without a copy), plus the job's own margins.

    A document job goes to the holder with the least expected wait, unless reading a copy of
    the document elsewhere would be quicker (the document is hot): then a copy opens there,
    up to `max_copies` per document.
    """

    profile: EngineProfile
    max_copies: int = DEFAULT_MAX_COPIES
    name: str = "expected_wait"
    weighs_loads: bool = True

    def start_s(self, work: Work, replica: ReplicaState, *, copy: bool) -> float:
        """Expected seconds until the job's first answer token on `replica`. The queries of
        the document ahead in turn on a holder's copy are not charged: charged a whole job
        each, `wim sim` at saturation answered fewer requests within the deadline (more
        copies took the session slots new sessions needed; docs/routing.md)."""
        return replica.backlog_s + first_token_s(self.profile, work, replica, copy=copy)

    def cost_s(self, work: Work, replica: ReplicaState, *, copy: bool) -> float:
        """What placing the job on `replica` costs: its expected wait, and for a request
        without a document the prefill of the prompt tokens that replica does not cache,
        `RECOMPUTE_CHARGE` times more. (A copy's read is charged once: it serves every later
        query of its document. Charged twice, `wim sim` of routing.md's document trace at 32
        replicas doubled p95.)"""
        seconds = self.start_s(work, replica, copy=copy)
        if work.document is None:
            cached = replica.cached_tokens(work)
            recompute = self.profile.prefill.seconds(work.prompt_tokens - cached, cached=cached)
            seconds += RECOMPUTE_CHARGE * recompute
        return seconds

    def place(self, work: Work, replicas: Sequence[ReplicaState]) -> Placement:
        held = holders(work, replicas)
        # (cost, whether a copy is read first, replica): a holder wins a tie, then the replica
        # with the most free KV (idle replicas tie: new sessions still spread), then the one
        # whose prefix cache the job's prompt evicts least recently used blocks from.
        options = [
            (self.cost_s(work, r, copy=False), False, r) for r in held if fits_holder(work, r)
        ]
        if work.document is None or len(held) < self.max_copies:
            copy = work.document is not None
            options += [
                (self.cost_s(work, r, copy=copy), copy, r)
                for r in with_room(work, replicas)
                if r not in held
            ]
        if not options:
            raise NoRoom(work, len(replicas))

        # Costs are compared to the millisecond: below that they are float residue (a backlog
        # summed and subtracted back to -1e-16 s), and residue must not break ties. It did in
        # `wim sim`: replicas that had run work won every tie against idle ones, and at 32
        # replicas new sessions piled onto a few of them while others stood empty.
        def rank(option: tuple[float, bool, ReplicaState]) -> tuple[float, bool, int]:
            return (round(option[0], 3), option[1], -option[2].free_blocks)

        first = min(rank(o) for o in options)
        # What a prompt would evict is asked of the tied options only: it reads each cache.
        _, copy, best = min(
            (o for o in options if rank(o) == first),
            key=lambda o: (o[2].eviction(work), o[2].replica),
        )
        seconds = self.start_s(work, best, copy=copy)
        if work.document is not None:
            cached = 0 if copy else work.document_tokens
        else:
            cached = best.cached_tokens(work)
        return Placement(
            best.replica, open_copy=copy, cached_tokens=cached, expected_wait_s=seconds
        )


@dataclass
class Sticky:
    """The service's placement before expected wait: a document stays on the replica it was
    first read on; a new document or one-shot job goes to the replica with the most free KV.
    For work without documents (a trace of plain requests), a request goes to the replica
    holding its longest cached prefix, the most free KV breaking ties."""

    name: str = "sticky"
    weighs_loads: bool = False

    def place(self, work: Work, replicas: Sequence[ReplicaState]) -> Placement:
        held = holders(work, replicas)
        if held:
            home = held[0]
            if not fits_holder(work, home):
                raise NoRoom(work, len(replicas))
            return Placement(home.replica, cached_tokens=work.document_tokens)
        fitting = with_room(work, replicas)
        if not fitting:
            raise NoRoom(work, len(replicas))
        best = max(
            fitting,
            key=lambda r: (r.cached_blocks(work), r.free_blocks, r.free_sessions, r.replica),
        )
        return Placement(
            best.replica,
            open_copy=work.document is not None,
            cached_tokens=best.cached_tokens(work),
        )


@dataclass
class RoundRobin:
    """Each job to the next replica in turn that can take it, whatever it holds: a document
    job on a replica without a copy reads one there."""

    name: str = "round_robin"
    weighs_loads: bool = False
    _turn: int = 0

    def place(self, work: Work, replicas: Sequence[ReplicaState]) -> Placement:
        held = {r.replica for r in holders(work, replicas)}
        fitting = [
            r
            for r in sorted(replicas, key=lambda r: r.replica)
            if (r.replica in held and fits_holder(work, r)) or r in with_room(work, [r])
        ]
        if not fitting:
            raise NoRoom(work, len(replicas))
        chosen = fitting[self._turn % len(fitting)]
        self._turn += 1
        copy = work.document is not None and chosen.replica not in held
        cached = work.document_tokens if chosen.replica in held else 0
        if work.document is None:
            cached = chosen.cached_tokens(work)
        return Placement(chosen.replica, open_copy=copy, cached_tokens=cached)


POLICIES = ("round_robin", "sticky", "expected_wait")
# Old names still accepted (configurations and scripts written with them keep working), each
# logged once per process as deprecated.
OLD_NAMES = {"wim": "expected_wait"}
_warned: set[str] = set()


def policy_name(name: str) -> str:
    """The policy's name: `name`, or the one an old name stands for (`OLD_NAMES`)."""
    current = OLD_NAMES.get(name)
    if current is None:
        return name
    if name not in _warned:
        _warned.add(name)
        logger.warning("placement policy %r is deprecated: it is called %r now", name, current)
    return current


def make_policy(
    name: str, profile: EngineProfile, *, max_copies: int = DEFAULT_MAX_COPIES
) -> PlacementPolicy:
    """The policy called `name` (one of `POLICIES`, or an old name of one)."""
    name = policy_name(name)
    if name == "round_robin":
        return RoundRobin()
    if name == "sticky":
        return Sticky()
    if name == "expected_wait":
        return ExpectedWait(profile, max_copies=max_copies)
    raise ValueError(f"unknown placement policy {name!r}; one of {', '.join(POLICIES)}")
