"""Which engine replica holds which session, and where a new session goes.

A session stays on the replica it was bound to for its whole life: adding replicas never
moves it (unlike a hash ring, whose ring changes with the replica set). A new session goes to
the replica with the most free KV among those that can hold its worst case (bounded load); a
replica that is draining or gone takes no new session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from wim_service.serving.replica.contracts import ReplicaLoad


class BindResult(StrEnum):
    HIT = "hit"  # the session's replica is alive: use it
    NEW = "new"  # a new session was placed
    REPIN = "repin"  # the session's replica is gone: moved elsewhere
    REJECTED = "rejected"  # nowhere to place it now


class NoCapacity(Exception):
    """No live replica can take the session now (every one is full or draining)."""

    def __init__(self, needed_blocks: int, live: int) -> None:
        super().__init__(f"no engine replica has room for {needed_blocks} KV blocks ({live} live)")
        self.live = live


@dataclass
class BindingTable:
    """Session id -> replica id, plus the latest load of every live replica."""

    bindings: dict[str, str] = field(default_factory=dict)
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    # The replicas Serve routes to, as of the last poll (with a load report or not).
    live: frozenset[str] = frozenset()

    def update_replicas(self, live: set[str] | frozenset[str], loads: list[ReplicaLoad]) -> None:
        """Take fresh loads; a live replica that missed this poll keeps its last report (a
        busy replica is not a gone one), a replica no longer live is dropped."""
        self.live = frozenset(live)
        fresh = {load.replica: load for load in loads}
        self.loads = {
            replica: fresh.get(replica) or self.loads[replica]
            for replica in live
            if replica in fresh or replica in self.loads
        }

    def replica_of(self, session: str) -> str | None:
        return self.bindings.get(session)

    def is_live(self, replica: str) -> bool:
        """Whether `replica` still holds its sessions: reported healthy, or routed to by Serve
        and not reported at all yet (just started, or its first poll timed out; another router
        may already have bound sessions to it). Only a report or a failed call condemns it."""
        load = self.loads.get(replica)
        return load.healthy if load is not None else replica in self.live

    def place(
        self, session: str | None, needed_blocks: int, *, exclude: set[str] | None = None
    ) -> str:
        """Bind `session` to the least-loaded live replica that can hold `needed_blocks`. With
        `session` None the replica is only chosen: document sessions are bound in the session
        store (compare-and-set), shared by every router."""
        candidates = [
            load
            for load in self.loads.values()
            if load.healthy and not load.draining and load.replica not in (exclude or set())
        ]
        # Room in KV and a free session slot: a replica at max_sessions would only queue the
        # session in its admission control and refuse it after a wait.
        fitting = [
            load
            for load in candidates
            if load.room_blocks >= needed_blocks and load.sessions < load.max_sessions
        ]
        if not fitting:
            raise NoCapacity(needed_blocks, len(candidates))
        best = max(fitting, key=lambda load: (load.room_blocks, -load.sessions, load.replica))
        if session is not None:
            self.bindings[session] = best.replica
        # Count the reservation now: the replica reports it only on its next poll, and a burst
        # of new sessions must not all land on the same "emptiest" replica meanwhile.
        best.reserved_blocks += needed_blocks
        best.sessions += 1
        return best.replica

    def unbind(self, session: str) -> None:
        self.bindings.pop(session, None)
