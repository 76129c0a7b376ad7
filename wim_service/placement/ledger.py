"""The bookkeeping around placement, one for the live router and for `wim sim`: each replica's
last load report, kept as it was taken, and the work placed there since, booked apart from it.

A replica reports its KV, session slots, backlog and running jobs only when it is asked; a burst
of work placed between two reports must not all land on the same "emptiest" replica, so each
placement is booked here at once (`Ledger.place`) and counts on top of the report until a newer
report includes it. Which report includes which booking is told by numbers, not by objects:
every booking (and every loss of a replica) takes the next number of the ledger, the caller
notes the ledger's number when it asks a replica for its load (`Ledger.mark`), and the report
taken with that mark (`Ledger.take_reports`) covers exactly the bookings numbered below it. A
report asked before a booking and answered after it does not drop the booking.

Work that ends stops counting at once (`done`), and work booked but never sent (`cancel`) as
if it had never been booked: a replica that looks full on bookings that ended refuses the next
job for nothing (docs/reliability.md, "A failover refused on phantom bookings").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from wim_service.placement.policy import PlacementPolicy, job_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import Placement, PrefixCache, ReplicaState, Work


@dataclass(frozen=True)
class LoadReport:
    """What a replica reported about itself (the router's `ReplicaLoad`, a simulated engine's
    state), never changed once taken: bookings are kept apart from it."""

    replica: str
    capacity_blocks: int
    reserved_blocks: int
    sessions: int
    max_sessions: int = 1 << 30  # sessions its admission control takes at once
    healthy: bool = True
    draining: bool = False
    backlog_s: float = 0.0  # expected seconds of admitted work still ahead of a new job
    running: int = 0  # jobs running (the batch a new job joins)

    @property
    def room_blocks(self) -> int:
        return self.capacity_blocks - self.reserved_blocks


@dataclass(frozen=True)
class Booking:
    """A placement and what it booked on its replica, numbered in the ledger's sequence: it
    counts on top of its replica's report until a report asked after it is taken."""

    placement: Placement
    number: int
    seconds: float  # expected seconds of the whole job (`placement.policy.job_s`)
    at: float  # the ledger's clock when it was booked
    blocks: int = 0  # KV blocks booked (a new copy's, a one-shot job's)
    sessions: int = 0  # session slots booked

    @property
    def replica(self) -> str:
        return self.placement.replica


@dataclass
class _Counted:
    """What of a booking still counts on top of its replica's report."""

    seconds: float
    running: int
    blocks: int
    sessions: int


@dataclass
class _Replica:
    report: LoadReport
    covers: int  # bookings numbered below this are in the report
    at: float  # the ledger's clock when the report was taken
    # Work the report counted that has ended since: taken off until the next report.
    ended_s: float = 0.0
    ended_running: int = 0
    lost: int | None = None  # the number of its loss, until a report asked after it
    bookings: dict[int, _Counted] = field(default_factory=dict)


def booked_on(work: Work, placement: Placement) -> tuple[int, int]:
    """The KV blocks and session slots a placement takes on its replica until it is reported:
    a one-shot job's or plain request's own KV (and a slot, unless a plain request's), a new
    copy's document; a query on a copy its replica holds takes neither (the session's own
    reservation holds one query)."""
    if work.document is None or placement.open_copy:
        return work.kv_blocks + work.document_blocks, int(work.takes_session)
    return 0, 0


class Ledger:
    """Every live replica's last report and the work booked on it since; where new work goes
    (by `policy`, booked here) and which one-shot job runs where."""

    def __init__(
        self,
        policy: PlacementPolicy,
        profile: EngineProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        estimate_prefixes: bool = True,
    ) -> None:
        self.policy = policy
        self.profile = profile
        self.clock = clock
        # Whether a placement records its prompt's prefix as cached on its replica: the
        # router's estimate of what each replica caches. `wim sim` sets the engines' own
        # caches in `prefixes` instead, exact, and they fill as the prefills run.
        self.estimate_prefixes = estimate_prefixes
        # The replicas Serve routes to, as of the last poll (with a report or not).
        self.live: frozenset[str] = frozenset()
        # The prompt blocks of the plain requests sent to each replica, as it is believed to
        # hold them in its prefix cache (the replica's own cache evicts on its own terms).
        self.prefixes: dict[str, PrefixCache] = {}
        self.bindings: dict[str, str] = {}  # a one-shot job's or plain request's id -> replica
        # When each live replica was last heard from: its last report taken, or when it was
        # first seen live without one.
        self.reported_at: dict[str, float] = {}
        self._replicas: dict[str, _Replica] = {}
        self._next = 0  # the number the next booking or loss takes

    # -- reports ---------------------------------------------------------------------------

    def mark(self) -> int:
        """The ledger's number now: note it when a replica is asked for its load, and give it
        with the report (`take_reports`); the report covers what was booked before."""
        return self._next

    def take_reports(
        self,
        live: Iterable[str],
        reports: Iterable[LoadReport],
        covers: Mapping[str, int] | None = None,
    ) -> None:
        """Take fresh reports (`covers`: each one's `mark` when it was asked; by default now);
        a live replica without one keeps its last (a busy replica is not a gone one), a
        replica no longer live is dropped with its bookings."""
        self.live = frozenset(live)
        now = self.clock()
        reports = list(reports)
        fresh = {report.replica for report in reports}
        self.reported_at = {
            r: now if r in fresh else self.reported_at.get(r, now) for r in self.live
        }
        for report in reports:
            if report.replica not in self.live:
                continue
            mark = self._next if covers is None else covers.get(report.replica, self._next)
            old = self._replicas.get(report.replica)
            entry = _Replica(report, mark, now)
            if old is not None:
                entry.bookings = {n: b for n, b in old.bookings.items() if n >= mark}
                entry.lost = old.lost if old.lost is not None and old.lost >= mark else None
            self._replicas[report.replica] = entry
        if self._replicas.keys() - self.live:
            self._replicas = {r: e for r, e in self._replicas.items() if r in self.live}
        if self.prefixes.keys() != self._replicas.keys():
            self.prefixes = {
                r: self.prefixes[r] if r in self.prefixes else PrefixCache(e.report.capacity_blocks)
                for r, e in self._replicas.items()
            }

    def load(self, replica: str) -> LoadReport | None:
        """`replica`'s report with the work booked and ended since (None: never reported)."""
        entry = self._replicas.get(replica)
        if entry is None:
            return None
        counted = entry.bookings.values()
        report = entry.report
        if not counted and not entry.ended_s and not entry.ended_running and entry.lost is None:
            return report  # nothing since: as reported (`wim sim` asks this at every placement)
        return replace(
            report,
            reserved_blocks=report.reserved_blocks + sum(b.blocks for b in counted),
            sessions=report.sessions + sum(b.sessions for b in counted),
            backlog_s=max(0.0, report.backlog_s - entry.ended_s) + sum(b.seconds for b in counted),
            running=max(0, report.running - entry.ended_running) + sum(b.running for b in counted),
            healthy=report.healthy and entry.lost is None,
        )

    @property
    def loads(self) -> dict[str, LoadReport]:
        """Every reported replica's load as placement sees it (`load`)."""
        loads = {r: self.load(r) for r in self._replicas}
        return {r: load for r, load in loads.items() if load is not None}

    def is_live(self, replica: str) -> bool:
        """Whether `replica` still holds its sessions: reported healthy, or routed to by Serve
        and not reported at all yet (just started, or its first poll timed out; another router
        may already have bound sessions to it). Only a report or a loss condemns it."""
        load = self.load(replica)
        return load.healthy if load is not None else replica in self.live

    def lose(self, replica: str, *, silent: bool = False) -> None:
        """Place nothing more on `replica` (a call to it failed) until a report asked after
        this says it is healthy; one that was lost for answering no load call (`silent`) is
        back with any report it answers."""
        entry = self._replicas.get(replica)
        if entry is not None:
            entry.lost = -1 if silent else self._take_number()

    # -- placement -------------------------------------------------------------------------

    def states(
        self, work: Work, exclude: Collection[str] = (), holders: Collection[str] = ()
    ) -> list[ReplicaState]:
        """The replicas that may take new work (reported healthy, not draining, not excluded),
        as placement sees them; `holders` hold a copy of the work's document."""
        document = frozenset([work.document] if work.document else [])
        states = []
        for load in self.loads.values():
            if not load.healthy or load.draining or load.replica in exclude:
                continue
            states.append(
                ReplicaState(
                    load.replica,
                    free_blocks=load.room_blocks,
                    free_sessions=load.max_sessions - load.sessions,
                    backlog_s=load.backlog_s,
                    running=load.running,
                    documents=document if load.replica in holders else frozenset(),
                    prefix_cache=self.prefixes.get(load.replica),
                )
            )
        return states

    def place(
        self,
        work: Work,
        *,
        session: str | None = None,
        exclude: Collection[str] = (),
        holders: Collection[str] = (),
    ) -> Booking:
        """Where `work` runs by the policy (raises `NoRoom`), booked there; `session` (a
        one-shot job's or a plain request's) is bound to it."""
        states = self.states(work, exclude, holders)
        placement = self.policy.place(work, states)
        state = next(s for s in states if s.replica == placement.replica)
        seconds = job_s(self.profile, work, state, copy=placement.open_copy)
        blocks, sessions = booked_on(work, placement)
        number = self._take_number()
        self._replicas[placement.replica].bookings[number] = _Counted(seconds, 1, blocks, sessions)
        if self.estimate_prefixes and work.prefix and state.prefix_cache is not None:
            state.prefix_cache.insert(work.prefix)
        if session is not None:
            self.bindings[session] = placement.replica
        return Booking(placement, number, seconds, self.clock(), blocks, sessions)

    def cancel(self, booking: Booking) -> None:
        """Work booked but never sent (a copy decided and then given up, a read that failed)
        stops counting at once, all of it: its seconds, its running job, its KV and session
        slot. A report that covers it counted none of it: nothing to undo then."""
        entry = self._replicas.get(booking.replica)
        if entry is not None:
            entry.bookings.pop(booking.number, None)

    def done(self, booking: Booking, seconds: float | None = None) -> None:
        """Work seen to end (a document read: the open call returned; a job) stops counting:
        `seconds` of it (all, and its running job, by default). Its KV and slot stay until a
        report says they are free. If a report covers it, that report counted what was left
        of it then, the replica's own estimate: about its cost less the time it had run."""
        entry = self._replicas.get(booking.replica)
        if entry is None:
            return
        ended = booking.seconds if seconds is None else seconds
        counted = entry.bookings.get(booking.number)
        if counted is not None:
            counted.seconds = max(0.0, counted.seconds - ended)
            if seconds is None:
                counted.seconds, counted.running = 0.0, 0
            return
        entry.ended_s += max(0.0, ended - max(0.0, entry.at - booking.at))
        if seconds is None:
            entry.ended_running += 1

    # -- bindings --------------------------------------------------------------------------

    def replica_of(self, session: str) -> str | None:
        return self.bindings.get(session)

    def unbind(self, session: str) -> None:
        self.bindings.pop(session, None)

    def _take_number(self) -> int:
        number, self._next = self._next, self._next + 1
        return number
