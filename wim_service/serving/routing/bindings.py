"""Which engine replica holds which job, and where new work goes.

The placement policy (`wim_service/placement/`, `RouterConfig.placement`) decides; this table
describes the replicas to it as `ReplicaState`s built from their last load reports, and books
each placement on the chosen replica's load at once (its KV, a session slot, its expected
seconds and a running job): a replica reports them only on its next poll, and a burst of new
work must not all land on the same "emptiest" replica meanwhile. A replica that is draining or
gone takes no new work. A document session's binding lives in the session store; this table
binds one-shot jobs and plain requests while they run.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

from wim_service.placement.policy import PlacementPolicy, job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import Placement, PrefixCache, ReplicaState, Work
from wim_service.serving.replica.contracts import ReplicaLoad


class BindResult(StrEnum):
    HIT = "hit"  # the session's replica is alive: use it
    NEW = "new"  # a new session was placed
    REPIN = "repin"  # the session's replica is gone: moved elsewhere
    REJECTED = "rejected"  # nowhere to place it now


@dataclass(frozen=True)
class Booking:
    """A placement and what it booked on its replica's load until the next report."""

    placement: Placement
    load: ReplicaLoad
    seconds: float
    at: float  # monotonic seconds it was booked
    blocks: int = 0  # KV blocks booked (a new copy's, a one-shot job's)
    sessions: int = 0  # session slots booked

    @property
    def replica(self) -> str:
        return self.placement.replica


@dataclass
class BindingTable:
    """Session id -> replica id, plus the latest load of every live replica."""

    policy: PlacementPolicy
    profile: EngineProfile
    bindings: dict[str, str] = field(default_factory=dict)
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    # The replicas Serve routes to, as of the last poll (with a load report or not).
    live: frozenset[str] = frozenset()
    # The prompt blocks of the plain requests sent to each replica, as it is believed to hold
    # them in its prefix cache (an estimate: the replica's own cache evicts on its own terms).
    prefixes: dict[str, PrefixCache] = field(default_factory=dict)
    # When each replica's current load was reported (monotonic seconds).
    reported_at: dict[str, float] = field(default_factory=dict)

    def update_replicas(self, live: set[str] | frozenset[str], loads: list[ReplicaLoad]) -> None:
        """Take fresh loads; a live replica that missed this poll keeps its last report (a
        busy replica is not a gone one), a replica no longer live is dropped."""
        self.live = frozenset(live)
        fresh = {load.replica: load for load in loads}
        now = time.monotonic()
        self.reported_at = {
            replica: now if replica in fresh else self.reported_at.get(replica, now)
            for replica in live
        }
        self.loads = {
            replica: fresh.get(replica) or self.loads[replica]
            for replica in live
            if replica in fresh or replica in self.loads
        }
        self.prefixes = {
            replica: self.prefixes.get(replica) or PrefixCache(load.capacity_blocks)
            for replica, load in self.loads.items()
        }

    def replica_of(self, session: str) -> str | None:
        return self.bindings.get(session)

    def is_live(self, replica: str) -> bool:
        """Whether `replica` still holds its sessions: reported healthy, or routed to by Serve
        and not reported at all yet (just started, or its first poll timed out; another router
        may already have bound sessions to it). Only a report or a failed call condemns it."""
        load = self.loads.get(replica)
        return load.healthy if load is not None else replica in self.live

    def states(
        self, work: Work, exclude: Collection[str], holders: Collection[str]
    ) -> list[ReplicaState]:
        """The replicas that may take new work (reported healthy, not draining, not excluded),
        as placement sees them; `holders` hold a copy of the work's document."""
        return [
            ReplicaState(
                load.replica,
                free_blocks=load.room_blocks,
                free_sessions=load.max_sessions - load.sessions,
                backlog_s=load.backlog_s,
                running=load.running,
                documents=frozenset(
                    [work.document] if work.document and load.replica in holders else []
                ),
                prefix_cache=self.prefixes.get(load.replica),
            )
            for load in self.loads.values()
            if load.healthy and not load.draining and load.replica not in exclude
        ]

    def place(
        self,
        session: str | None,
        work: Work,
        *,
        exclude: Collection[str] = (),
        holders: Collection[str] = (),
    ) -> Booking:
        """Where `work` runs (raises `NoRoom`), booked there; `session` (a one-shot job's or a
        plain request's) is bound to it. Document sessions are bound in the session store
        (compare-and-set), shared by every router."""
        states = self.states(work, exclude, holders)
        placement = self.policy.place(work, states)
        state = next(s for s in states if s.replica == placement.replica)
        load = self.loads[placement.replica]
        seconds = job_s(self.profile, work, state, copy=placement.open_copy)
        load.backlog_s += seconds
        load.running += 1
        blocks, sessions = 0, 0
        if work.document is None or placement.open_copy:
            # New KV, and a session slot unless a plain request's: a query on a copy it holds
            # takes neither (the session's own reservation holds one query).
            blocks, sessions = work.kv_blocks + work.document_blocks, int(work.takes_session)
            load.reserved_blocks += blocks
            load.sessions += sessions
        if work.prefix and state.prefix_cache is not None:
            state.prefix_cache.insert(work.prefix)
        if session is not None:
            self.bindings[session] = placement.replica
        return Booking(placement, load, seconds, time.monotonic(), blocks, sessions)

    def cancel(self, booking: Booking) -> None:
        """Work booked but never sent (a copy decided and then given up, a read that failed)
        stops counting at once, all of it: its seconds, its running job, and the KV and session
        slot it booked. Left until the next report, they made the replica look full, and a node
        loss stalls the reports: a session's rebuild was refused on them (docs/reliability.md,
        "A failover refused on phantom bookings"). A fresh
        report taken since never counted it: nothing to undo then."""
        load = self.loads.get(booking.replica)
        if load is not booking.load:
            return
        self.done(booking)  # its seconds and running job
        load.reserved_blocks -= booking.blocks
        load.sessions -= booking.sessions

    def done(self, booking: Booking, seconds: float | None = None) -> None:
        """Work the router saw end (a document read: the open call returned; a job) stops
        counting: `seconds` of it (all by default). If a fresh report replaced the load it was
        booked on, that report counted what was left of it then, the replica's own estimate:
        about its cost less the time it had run."""
        ended = booking.seconds if seconds is None else seconds
        load = self.loads.get(booking.replica)
        if load is None:
            return
        if load is not booking.load:
            ended -= self.reported_at.get(booking.replica, booking.at) - booking.at
        load.backlog_s = max(0.0, load.backlog_s - max(0.0, ended))
        if seconds is None:
            load.running = max(0, load.running - 1)

    def unbind(self, session: str) -> None:
        self.bindings.pop(session, None)
