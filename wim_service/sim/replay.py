"""The simulator's core: a trace replayed over N simulated engines through a placement policy.

Events (arrivals, the end of an engine's prefill or decode run, a copy's idle check, a poll of
the engines' reports, a job's deadline) are kept in one heap, in time order. Placement sees the
engines as the router sees its replicas: their load reports taken at each poll (`load_poll_s`)
and asked again before a refusal or a copy (at most once per `FRESH_LOADS_S`), with what was
placed since booked on top in the router's ledger; the policy (the code the live router runs)
picks a replica, and a query's copy opens by the router's rules (`placement/copies.py`). What
finds no room is refused as the service refuses it (`429` with Retry-After): a new session or
job no replica has room for, after idle spare copies were reclaimed, and a call past the engine
replicas' queue bound; with `expected_wait`, while the fleet is short, an arrival costlier than
cheapest-first admission's water level (`placement/admission.py`). Its client sends it again
after the Retry-After if its trace row says so (`retries`); the waits count in its time to
first token.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from wim_service.placement.admission import AdmissionRule, cheapest_first
from wim_service.placement.copies import CopyBook, QuerySteps
from wim_service.placement.ledger import Booking, Ledger
from wim_service.placement.no_room import NoRoomSteps, Step
from wim_service.placement.policy import PlacementPolicy, make_policy
from wim_service.placement.polls import Fresh
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Work
from wim_service.sim.engine import Engine
from wim_service.sim.jobs import Job, read_work, work_for
from wim_service.sim.result import Outcome, RunResult
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request, Trace

ARRIVAL, ENGINE, RETIRE, RETRY, LOSE, POLL, DEADLINE = 0, 1, 2, 3, 4, 5, 6
# A replica lost mid-replay: when (seconds into the trace) and which (its engine's index).
Loss = tuple[float, int]
# A copy retires once idle for copy_idle_s; float sums may land a hair short of it.
IDLE_SLACK_S = 1e-9


class Replay:
    """One policy over one fleet: `run()` to the end, or in steps (`run(until)`)."""

    def __init__(
        self,
        trace: Trace,
        policy: str,
        replicas: int,
        profile: EngineProfile,
        settings: SimSettings,
        losses: Sequence[Loss] = (),
    ) -> None:
        # Every copy is charged through this profile, in placement and on the engines alike.
        profile = profile.for_store(settings.restore_copies)
        self.trace, self.profile, self.settings = trace, profile, settings
        self.policy: PlacementPolicy = make_policy(policy, profile, max_copies=settings.max_copies)
        # Placement reads and books through the router's ledger, at the replay's clock; the
        # engines' own prefix caches, exact, stand for the router's estimates.
        self.now = 0.0
        self.ledger = Ledger(self.policy, profile, clock=lambda: self.now, estimate_prefixes=False)
        self._fresh = Fresh()  # when a refusal or a copy asks for the reports again
        # The router's admission at arrival (`Dispatcher`): `expected_wait`'s, if set on.
        on, deadline_s = settings.cheapest_first, settings.deadline_s
        self.admission = cheapest_first(
            self.policy.name, on, AdmissionRule(), lambda: self.now, deadline_s
        )
        # Documents whose copy is being read, by the query it opened for: the router reads
        # one copy of a document at a time, and a copy takes queries once read.
        self._copying: dict[str, Job] = {}
        # The copies opened beside sessions' primaries and the queries on each holder, kept as
        # the router keeps its own (`DocumentCopies`): what a reclaim may close.
        self.copies = CopyBook()
        self.engines = [
            Engine(
                i,
                profile,
                settings.slots,
                self._schedule,
                prefix_block_tokens=trace.block_tokens,
                side_by_side_kv_reserve=settings.side_by_side_kv_reserve,
            )
            for i in range(replicas)
        ]
        self.by_name = {engine.name: engine for engine in self.engines}
        self.ledger.prefixes = {engine.name: engine.cache for engine in self.engines}
        arrivals = [r.arrival_s for r in trace.requests]
        self.result = RunResult.before(policy, replicas, arrivals, settings.deadline_s)
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._order = itertools.count()  # ties in time: first scheduled, first handled
        # Documents whose session is being opened: the queries that wait for it, in order.
        self._opening: dict[str, list[Job]] = {}
        self._calls = [0] * replicas  # calls each engine replica has open (jobs placed there)
        self._refusals: Counter[int] = Counter()  # by request index
        self._on: list[set[Job]] = [set() for _ in range(replicas)]  # placed there, not done
        # Documents whose every holder was lost: their next read restores what was saved.
        self._rebuilt: set[str] = set()
        self._push(0.0, POLL, None, None)  # the router polls as it starts
        # A loss first: what arrives at the same time finds the replica gone.
        for at, index in losses:
            self._push(at, LOSE, self.engines[index], None)
        for request in trace.requests:
            self._push(request.arrival_s, ARRIVAL, request, None)

    def _push(self, time: float, kind: int, subject: Any, detail: Any) -> None:
        heapq.heappush(self._heap, (time, next(self._order), kind, subject, detail))

    def _schedule(self, engine: Engine, time: float) -> None:
        self._push(time, ENGINE, engine, engine.version)

    def run(self, until: float = math.inf) -> RunResult:
        """Replay what happens until `until` (seconds into the trace; by default all)."""
        while self._heap and self._heap[0][0] <= until:
            now, _, kind, subject, detail = heapq.heappop(self._heap)
            self.now = now
            self.result.events += 1
            if kind == ENGINE:
                if detail == subject.version:  # else a decode run cut short since
                    subject.wake(now)
            elif kind == ARRIVAL:
                self._arrive(subject, now)
            elif kind == RETRY:  # a request sent again: its session opened again if need be
                (self._submit if subject.work.reads_only else self._begin)(subject, now)
            elif kind == LOSE:
                self._lose(subject, now)
            elif kind == DEADLINE:
                self._expire(subject, detail, now)
            elif kind == POLL:
                self._poll()
                if self._heap:  # else the replay is over
                    self._push(now + self.settings.load_poll_s, POLL, None, None)
            elif subject.retire_if_idle(detail, now, self.settings.copy_idle_s - IDLE_SLACK_S):
                self.copies.closed(detail, subject.name)
                self.result.copies_retired += 1
        return self.result

    def _arrive(self, request: Request, now: float) -> None:
        job = Job(
            request,
            work_for(request, self.profile, self.settings, self.trace.block_tokens),
            self.settings,
            self._done,
        )
        capacity = self.engines[0].capacity_blocks
        if job.work.kv_blocks + job.work.document_blocks > capacity:
            self.result.too_large += 1
            return
        self._begin(job, now)

    def _begin(self, job: Job, now: float) -> None:
        """Place a job, a query once its document's session is open."""
        document = job.work.document
        if document is not None and document in self._opening:
            self._opening[document].append(job)  # placed once the session is open
            return
        if document is not None and not self._held(document):
            if self._turned_away(job, now):  # opened as its first query is admitted
                return
            # As the live client does: open the session (placed on its own), then ask. A
            # session whose every holder was lost is rebuilt so: its KV restored if saved.
            self._opening[document] = [job]
            restorable = document in self._rebuilt
            self._rebuilt.discard(document)
            read = read_work(job.work, restorable=restorable)
            job = Job(job.request, read, self.settings, self._opened)
        self._submit(job, now)

    def _held(self, document: str) -> bool:
        """Whether some engine holds a copy of `document`."""
        return any(document in engine.copies for engine in self.engines)

    def _submit(self, job: Job, now: float) -> None:
        """Admit and place the job, or refuse it. A query of a held document needs no new
        room: it queues at a copy, as a live query waits its session's turn."""
        if self._turned_away(job, now):
            return
        if not self._place(job, now):
            if self.admission is not None:
                self.admission.fell_short()
            self._refuse(job, now)

    def _turned_away(self, job: Job, now: float) -> bool:
        """Whether cheapest-first admission refuses the job (then refused here), as the
        router's `Dispatcher` asks it: a query (a new session's as it opens), a plain request
        or a retry of either; a session's read, and a job failed over (admitted already), are
        not asked."""
        if self.admission is None or job.work.reads_only or job.cost is not None:
            return False
        verdict = self.admission.admit(self.ledger, job.work)
        if verdict.admitted:
            job.cost = verdict.cost
            return False
        self.result.turned_away += 1
        self._refuse(job, now)
        return True

    def _refuse(self, job: Job, now: float) -> None:
        """`429` with Retry-After: the client sends the request again after it if its row
        says so; else it is refused for good, and with a session's read every query waiting
        for that session (as each live query of a session that failed to open fails)."""
        request = job.request
        self._refusals[request.index] += 1
        retries = self.settings.retries if request.retries is None else request.retries
        if self._refusals[request.index] <= retries:
            self.result.retried += 1
            job.due_s = math.inf  # a new send: the router's clock starts again
            job.cost = None  # and admission asked again
            self._push(now + self.settings.retry_after_s, RETRY, job, None)
        elif job.work.reads_only:
            assert job.work.document is not None
            self.result.refused += len(self._opening.pop(job.work.document))
        else:
            self.result.refused += 1

    def _takes_call(self, engine: Engine) -> bool:
        """Whether a call to `engine` is taken: it has fewer than `replica_calls` open, or the
        router's queue for the engines (the calls past each one's bound) has room."""
        bound = self.settings.replica_calls
        if self._calls[engine.index] < bound:
            return True
        return sum(max(0, calls - bound) for calls in self._calls) < self.settings.queued_calls

    def _opened(self, read: Job, engine: Engine, now: float) -> None:
        """A session's read ended: its queries are placed now, in their order."""
        self._calls[engine.index] -= 1
        self._on[engine.index].discard(read)
        if read.booking is not None:
            self.ledger.done(read.booking)
        document = read.work.document
        assert document is not None
        self._rebuilt.discard(document)  # a read lost with its replica was read again
        for job in self._opening.pop(document):
            self._submit(job, now)
        if not engine.copies[document].active:  # every query went to another replica
            self._push(now + self.settings.copy_idle_s, RETIRE, engine, document)

    def _place(self, job: Job, now: float) -> bool:
        work, document = job.work, job.work.document
        query = document is not None and not work.reads_only
        if query:
            replica, booking = self._holder(work)
        else:
            booking = self._booked(work, now)
            if booking is None:
                return False
            replica = booking.replica
        engine = self.by_name[replica]
        if not self._takes_call(engine):
            if booking is not None:
                self.ledger.cancel(booking)
            return False
        self._calls[engine.index] += 1
        self._on[engine.index].add(job)
        job.booking = booking
        job.copy = booking is not None and booking.placement.open_copy
        self.result.copies_opened += job.copy
        if query:  # on a holder, or a copy opened beside the session's primary
            assert document is not None
            if job.copy:
                self.copies.opened(document, engine.name, now)
                self._copying[document] = job
                job.on_read = self._copy_read
            self.copies.begin(document, engine.name)
        job.start(engine, now)
        if not work.reads_only:  # a session's read has no deadline (`POST /documents`)
            job.due_s = min(job.due_s, now + self.settings.deadline_s)
            self._push(job.due_s, DEADLINE, job, engine)
        return True

    def _poll(self) -> None:
        """Every live engine's report, as the router's poll takes its replicas'."""
        live = [e for e in self.engines if not e.lost]
        self.ledger.take_reports([e.name for e in live], [e.report(self.now) for e in live])

    def _ask_fresh(self) -> None:
        """The reports asked again for a decision, as the router's `fresh_loads` asks."""
        if not self._fresh.holds(self.now):
            self._fresh.took(self.now)
            self._poll()

    def _booked(self, work: Work, now: float) -> Booking | None:
        """Where a session's read or a plain request runs, booked, as the router places it
        (`ReplicaFleet.place`), with no room taking the same steps (`NoRoomSteps`): placed
        again on loads asked again, then after a reclaim of spare copies; None: refused."""
        steps = NoRoomSteps(reclaims=True)
        while True:
            try:
                return self.ledger.place(work)
            except NoRoom as exc:
                step = steps.after(exc.replicas)
            if step is Step.RECLAIM:
                step = steps.reclaimed(self._reclaim(now))
            if step is Step.REFUSE:
                return None
            (self._ask_fresh if step is Step.REFRESH else self._poll)()

    def _holder(self, work: Work) -> tuple[str, Booking | None]:
        """Where a query of a held document runs, as the router decides it
        (`DocumentCopies.holder`), by the same steps (`QuerySteps`): on the holder or new copy
        the policy picks among the copies read, booked there; else on its session's primary."""
        document = work.document
        assert document is not None
        held = [e for e in self.engines if document in e.copies]
        holders = [e.name for e in held if e.copies[document].read]
        steps = QuerySteps(self.ledger, work)
        while steps.place(holders):
            self._ask_fresh()
        booking = steps.settle(holders, self.settings.max_copies, document in self._copying)
        if booking is not None:
            return booking.replica, booking
        primaries = [e.name for e in held if (document, e.name) not in self.copies]
        return (primaries or holders or [held[0].name])[0], None

    def _copy_read(self, job: Job, now: float) -> None:
        """A query's new copy is read: its read stops counting in the ledger (the router's
        `read_copy`), and the document may open another."""
        document = job.work.document
        assert document is not None
        if job.booking is not None:
            read_s = self.profile.read_seconds(job.work.document_tokens, saved=True)
            self.ledger.done(job.booking, read_s)
        if self._copying.get(document) is job:
            del self._copying[document]

    def _reclaim(self, now: float) -> int:
        """Retire the spare copies (`CopyBook.spare`: as the live router's
        `DocumentCopies.reclaim` chooses them, from the same book of copies): when no replica
        has room, a spare copy's KV and session slot serve new work better than its
        document's next query would."""
        holders = Counter(document for engine in self.engines for document in engine.copies)
        retired = 0
        for document, name in self.copies.spare(now, holders=holders):
            if self.by_name[name].retire_if_idle(document, now, 0.0):
                self.copies.closed(document, name)
                retired += 1
        self.result.copies_retired += retired
        self.result.copies_reclaimed += retired
        return retired

    def _lose(self, engine: Engine, now: float) -> None:
        """`engine`'s replica dies, as the live router sees one die: placement no longer sees
        it (its bookings go with it); its copies are gone, a session whose primary it held
        taken over by its first live copy, or read again at its next query (restored if its
        KV was saved: `failover.py`); the jobs on it fail over, a session's read or query placed
        again (its query on its session's new holders), a plain request failed (503 with
        Retry-After: counted with the refused unless its client retries)."""
        for document in engine.copies:
            primary = (document, engine.name) not in self.copies
            self.copies.closed(document, engine.name)
            if not primary:
                continue
            heirs = [r for r in self.copies.holders(document) if not self.by_name[r].lost]
            if heirs:
                self.copies.closed(document, heirs[0])  # the session's primary now
            elif not any(document in e.copies for e in self.engines if e is not engine):
                self._rebuilt.add(document)
        engine.lose()
        self.ledger.lose(engine.name)  # its calls fail: the router places nothing more there
        self._calls[engine.index] = 0
        jobs, self._on[engine.index] = self._on[engine.index], set()
        self._copying = {d: j for d, j in self._copying.items() if j not in jobs}
        for job in sorted(jobs, key=lambda j: (j.placed_s, j.request.index)):
            again = Job(
                job.request, job.work, self.settings, job.on_done, due_s=job.due_s, cost=job.cost
            )
            held = job.work.document
            if held is None:
                self._refuse(again, now)
            elif job.work.reads_only:
                self._submit(again, now)
            else:
                self.copies.end(held, engine.name, now)
                self._begin(again, now)

    def _done(self, job: Job, engine: Engine, now: float) -> None:
        assert job.first_token_s is not None
        if self.admission is not None and job.cost is not None:
            # Its time on the engine, as a replica measures a job's (`Timings`).
            self.admission.answered(job.cost, now - job.placed_s)
        request = job.request
        self.result.outcomes.append(
            Outcome(
                index=request.index,
                arrival_s=request.arrival_s,
                first_token_s=job.first_token_s,
                end_s=now,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=job.cached_tokens,
                replica=engine.index,
            )
        )
        self._ended(job, engine, now)

    def _expire(self, job: Job, engine: Engine, now: float) -> None:
        """A job still on its engine at its deadline is stopped, as the router stops it:
        the engine aborts it, its booking ends, and it is counted as timed out (the fleet
        fell short, for cheapest-first admission, as the router tells it)."""
        if job in self._on[engine.index]:  # else answered, or failed over
            self.result.timed_out += 1
            if self.admission is not None:
                self.admission.fell_short()
            self._ended(job, engine, now, unread=job.stop(engine, now))

    def _ended(self, job: Job, engine: Engine, now: float, *, unread: bool = False) -> None:
        """A job is off its engine; a copy it opened and did not read is closed, as the
        router's cancelled read leaves none (`DocumentCopies.read_copy`)."""
        self._calls[engine.index] -= 1
        self._on[engine.index].discard(job)
        if job.booking is not None:
            (self.ledger.cancel if unread else self.ledger.done)(job.booking)
        document = job.work.document
        if document is None:
            return
        self.copies.end(document, engine.name, now)
        if unread:
            if engine.retire_if_idle(document, now, 0.0):
                self.copies.closed(document, engine.name)
            if self._copying.get(document) is job:
                del self._copying[document]
        elif not engine.copies[document].active:
            self._push(now + self.settings.copy_idle_s, RETIRE, engine, document)


def simulate(
    trace: Trace,
    policy: str,
    replicas: int,
    profile: EngineProfile,
    settings: SimSettings | None = None,
    losses: Sequence[Loss] = (),
) -> RunResult:
    """Replay `trace` over `replicas` engines placed by `policy`, losing `losses`."""
    return Replay(trace, policy, replicas, profile, settings or SimSettings(), losses).run()
