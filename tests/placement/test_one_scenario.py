"""One scripted scenario through the live router (over scripted fake replicas) and through
`wim sim`, for every placement policy that ships: both place and book through the same ledger
and keep the same book of copies, so they must make the same placements, hold the same copies
and reclaim the same ones, step by step.

The scenario: a run of queries on a hot document and one on a cold one (under round robin
copies open on the replicas without them); a burst of both at one instant; then the replica
holding the hot document's primary is lost (its copies go, its sessions fail over: to a live
copy, or read again elsewhere at their next query) and both documents are queried again, one
after another and then in a burst; then two new documents as the session slots fill, which
find room only once idle copies are reclaimed (round robin's). A document's session opens
just before its first query, as `wim sim`'s clients do. Every replica reserves the same KV
for a session as the router books for it, and books its backlog as a real one does
(`placement/backlog.py`: a copy's read, then the query), at the scenario's clock.

A step's queries run one after another, `GAP_S` apart in the trace, each ended before the
next arrives; or in a burst, all at one instant. Both sides take the replicas' reports as
the router does (`placement/polls.py`: here only before a refusal or a copy, the poll being
longer than the scenario) and book what they place in between, so a burst is placed on the
same loads. The router here places a burst's queries in the trace's order, each sent before
the next arrives, and holds their reads and queries on the replicas until the last is
placed (`Gate`): in the trace they all arrive before any of them ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.fake_service import ScriptedClient, ScriptedReplica, segment_spans
from tests.fakes.profile import PROFILE
from tests.sim.test_sim import doc_row, document_trace
from wim_service.placement.backlog import Backlog
from wim_service.placement.copies import CopyBook
from wim_service.placement.ledger import Booking, Ledger
from wim_service.placement.policy import POLICIES
from wim_service.placement.polls import FRESH_LOADS_S
from wim_service.placement.state import Work
from wim_service.serving.replica.contracts import OpenResult, ReplicaLoad
from wim_service.serving.replica.work import estimated_tokens, session_work
from wim_service.serving.routing.recent import Recent
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoredSession
from wim_service.sim.replay import Replay
from wim_service.sim.settings import SimSettings
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions

REPLICAS = ("r00", "r01", "r02")
SLOTS = 2  # session slots per replica: copies and sessions alike
TEXT = "The night gate code is 4417. Ask Marta at the harbour office about it. " * 40
QUERY = "What is the night gate code?"
IDLE_S = 10_000.0  # no copy retires for idleness: only a reclaim closes one
GAP_S = 60.0  # between two queries of a step in the trace: each has ended by the next
STEP_S = 500.0  # between two steps
POLL_S = 3600.0  # longer than the scenario: reports are asked only for a refusal or a copy
ANSWER_TOKENS = WiMOptions().answer_max_tokens


@dataclass(frozen=True)
class Step:
    queried: tuple[str, ...]  # queries, in order (the trace's rows)
    lose: str | None = None  # first the replica holding this document's primary is lost
    burst: bool = False  # every query arrives at the step's start (of documents open)


STEPS = [
    Step(("hot", "hot", "hot", "cold")),
    Step(("hot", "hot", "cold", "hot", "hot", "hot"), burst=True),
    Step(("hot", "cold", "hot"), lose="hot"),
    Step(("hot", "hot", "cold", "hot", "hot"), burst=True),
    Step(("c", "d")),
]


class Gate:
    """Holds the reads and queries sent to the replicas while closed (a burst is being
    placed), and counts those it holds."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.opened.set()
        self.held = 0
        self.changed = asyncio.Event()

    async def passing(self) -> None:
        if not self.opened.is_set():
            self.held += 1
            self.changed.set()
        await self.opened.wait()

    async def until_held(self, count: int, task: asyncio.Task[None]) -> None:
        """Until `count` are held, or `task` (the last query sent) has ended."""
        task.add_done_callback(lambda _: self.changed.set())
        while self.held < count and not task.done():
            self.changed.clear()
            await self.changed.wait()


class Reserving(ScriptedReplica):
    """A scripted replica that reserves `session_blocks` of KV for each session it holds and
    reports its backlog as a real replica books it, at the scenario's clock."""

    session_blocks = 0

    def __init__(self, name: str, gate: Gate, clock: Clock) -> None:
        super().__init__(name)
        self.gate = gate
        self.backlog = Backlog(PROFILE.for_store(True), clock=clock)  # as the router's
        self.dtype = PROFILE.dtype

    async def load(self) -> ReplicaLoad:
        self.reserved = self.session_blocks * len(self.documents)
        # Its own books, not the jobs `ScriptedClient` counts as they stream.
        self.backlog_s, self.running = self.backlog.seconds(), self.backlog.running
        return await super().load()

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        tokens = len(document) // 4
        work = session_work(document_id, tokens, 0, options, restorable=restore)
        with self.backlog.job(work, copy=True):
            await self.gate.passing()
            return await super().open_document(document_id, document, options, tenant, restore)

    async def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        tokens, segments = len(TEXT) // 4, len(segment_spans(TEXT, options.segment_tokens * 4))
        work = session_work(document_id, tokens, 0, options, query=query, segments=segments)
        with self.backlog.job(work):
            await self.gate.passing()
            async for event in super().query_document(document_id, query, options):
                yield event


class Clock:
    """The scenario's time on the router's side: `at` seconds into the trace."""

    def __init__(self) -> None:
        # From the monotonic clock's now: the router judges silent replicas by that clock.
        self.base = time.monotonic()
        self.at = 0.0

    def __call__(self) -> float:
        return self.base + self.at


Placed = tuple[str | None, bool, str, bool]  # (document, a read, replica, a copy opened)
Held = set[tuple[str, str]]  # (document, replica) of every copy and primary


@dataclass
class Record:
    """What one side did in one step."""

    placed: list[Placed]
    # (document, replica) of each query run, booked or not (one whose copy may not open runs
    # on its session's primary unbooked), sorted: a copy's query starts once it is read.
    ran: list[tuple[str, str]]
    closed: list[tuple[str, str]]  # (document, replica) of each copy a reclaim closed
    held: Held  # at the step's end


def recording(ledger: Ledger, book: CopyBook, steps: Steps) -> None:
    """Record every placement `ledger` makes that stands (one cancelled is dropped again:
    the router weighs a copy on fresh loads, and cancels the placement it made on old ones),
    and every query that runs on a holder of its document (`book`)."""
    place, cancel, begin = ledger.place, ledger.cancel, book.begin
    placed = steps.placed

    def recorded(work: Work, **kw: Any) -> Booking:
        booking = place(work, **kw)
        placement = booking.placement
        placed[booking.number] = (
            work.document,
            work.reads_only,
            placement.replica,
            placement.open_copy,
        )
        return booking

    def cancelled(booking: Booking) -> None:
        placed.pop(booking.number, None)
        cancel(booking)

    def began(document: str, replica: str) -> None:
        steps.ran.append((document, replica))
        begin(document, replica)

    ledger.place = recorded  # type: ignore[method-assign]
    ledger.cancel = cancelled  # type: ignore[method-assign]
    book.begin = began  # type: ignore[method-assign]


def held(holders: dict[str, Any]) -> Held:
    return {(document, name) for name, documents in holders.items() for document in documents}


class Steps:
    """Each step's record, cut from what one side placed and closed so far."""

    def __init__(self) -> None:
        self.placed: dict[int, Placed] = {}
        self.ran: list[tuple[str, str]] = []
        self.closed: list[tuple[str, str]] = []
        self.records: list[Record] = []
        self._placed = self._ran = self._closed = 0

    def cut(self, holding: Held) -> None:
        placed = list(self.placed.values())
        ran = sorted(self.ran[self._ran :])
        closed = self.closed[self._closed :]
        self.records.append(Record(placed[self._placed :], ran, closed, holding))
        self._placed, self._ran, self._closed = len(placed), len(self.ran), len(self.closed)


def arrivals(number: int, step: Step) -> list[float]:
    """When each of the step's queries arrives, in seconds into the trace."""
    return [number * STEP_S + (0.0 if step.burst else i * GAP_S) for i in range(len(step.queried))]


async def through_the_router(tmp_path: Path, policy: str) -> tuple[list[Record], str]:
    """Each step's record, and the replica lost."""
    profile = tmp_path / "profile.json"  # the simulator's, copies restored as it has them
    profile.write_text(PROFILE.model_dump_json())
    gate, clock = Gate(), Clock()
    replicas = {name: Reserving(name, gate, clock) for name in REPLICAS}
    settings = {
        "replica_wait_s": 0,
        "load_poll_interval_s": POLL_S,
        "cost_profile": str(profile),
        "restore_copies": True,
        # Silence is judged by the monotonic clock against times the ledger took at the
        # scenario's: no replica here is ever silent, however slow the machine.
        "replica_silence_s": IDLE_S,
        "placement": policy,
        "copy_idle_s": IDLE_S,
    }
    client = ScriptedClient(*replicas.values(), job_s=0.0)  # the replicas book their own
    router = WiMRouter(None, {"router": settings}, client=client, http_host="127.0.0.1")
    fleet = router.fleet
    fleet.ledger.clock = clock
    fleet.fresh_loads = Recent(fleet.refresh_loads, FRESH_LOADS_S, clock=clock)
    sizer = router.dispatcher.sizer
    shape = await sizer.shape(TEXT, WiMOptions(), None)
    for replica in replicas.values():
        replica.max_sessions = SLOTS
        replica.session_blocks = sizer.blocks(shape, one_shot=False)
    await router.fleet.refresh_loads()
    steps = Steps()
    recording(router.fleet.ledger, router.dispatcher.copies.book, steps)
    copies = router.dispatcher.copies
    reclaim = copies.reclaim

    def holding() -> Held:
        return held({name: r.documents for name, r in replicas.items() if not r.dead})

    async def reclaimed(*args: Any) -> int:
        before = holding()
        count = await reclaim(*args)
        steps.closed.extend(sorted(before - holding()))
        return count

    # Passed in explicitly: to the dispatcher's placements at each call, to the failover's
    # (which reads new documents) when it was made.
    copies.reclaim = router.dispatcher.failover.reclaim = reclaimed  # type: ignore[method-assign]

    async def ask(document: str) -> None:
        record = await router.documents.get(document)
        if record is None:
            session = StoredSession(document, WiMOptions(), ttl_s=IDLE_S)
            record = await router.dispatcher.open_document(session, TEXT)
        job = router.dispatcher.job(document, QUERY, WiMOptions(), record=record)
        items = [item async for item in job]
        assert items[-1][1].type == "done"

    lost = ""
    for number, step in enumerate(STEPS):
        times = arrivals(number, step)
        clock.at = times[0]
        if step.lose is not None:
            session = await router.documents.get(step.lose)
            assert session is not None and session.replica is not None
            lost = session.replica
            replicas[lost].dead = True  # Serve routes to it no more, and calls to it fail
            fleet.lost(lost, "replica_lost")
        if not step.burst:
            for at, document in zip(times, step.queried, strict=True):
                clock.at = at
                await ask(document)
            steps.cut(holding())
            continue
        gate.opened.clear()
        gate.held = 0
        tasks = []
        for document in step.queried:
            tasks.append(asyncio.create_task(ask(document)))
            await gate.until_held(len(tasks), tasks[-1])  # placed: then the next arrives
        gate.opened.set()
        await asyncio.gather(*tasks)
        steps.cut(holding())
    router.shutdown()
    return steps.records, lost


def through_the_simulator(tmp_path: Path, policy: str, lost: str) -> list[Record]:
    tokens = len(TEXT) // 4  # as the fake replicas read it
    # Each query as the router shapes it (`serving/replica/work.py`).
    shape = {"query_tokens": estimated_tokens(QUERY), "answer_tokens": ANSWER_TOKENS}
    rows = [
        doc_row(at, document, wim=True, tokens=tokens) | shape
        for number, step in enumerate(STEPS)
        for at, document in zip(arrivals(number, step), step.queried, strict=True)
    ]
    settings = SimSettings(slots=SLOTS, copy_idle_s=IDLE_S, load_poll_s=POLL_S)
    trace = document_trace(rows, tmp_path)
    at = next(number * STEP_S for number, step in enumerate(STEPS) if step.lose)
    losses = [(at, REPLICAS.index(lost))]
    replay = Replay(trace, policy, len(REPLICAS), PROFILE, settings, losses)
    steps = Steps()
    recording(replay.ledger, replay.copies, steps)
    reclaim = replay._reclaim

    def holding() -> Held:
        return held({e.name: e.copies for e in replay.engines if not e.lost})

    def reclaimed(now: float) -> int:
        before = holding()
        count = reclaim(now)
        steps.closed.extend(sorted(before - holding()))
        return count

    replay._reclaim = reclaimed  # type: ignore[method-assign]
    for number in range(len(STEPS)):
        # Every step's work ends well before the next step starts.
        replay.run(until=(number + 1) * STEP_S - 1.0)
        steps.cut(holding())
    result = replay.run()
    assert len(result.outcomes) == len(rows) and result.refused == 0
    assert result.copies_reclaimed == sum(len(r.closed) for r in steps.records)
    return steps.records


@pytest.mark.parametrize("policy", POLICIES)
async def test_the_router_and_the_simulator_place_one_scenario_alike(
    tmp_path: Path, policy: str
) -> None:
    routed, lost = await through_the_router(tmp_path, policy)
    simulated = through_the_simulator(tmp_path, policy, lost)
    for number, (live, replayed) in enumerate(zip(routed, simulated, strict=True)):
        assert live == replayed, f"step {number}"  # placements, reclaims, then holders
    placed = [p for record in routed for p in record.placed]
    # The scenario does what it is for: the lost replica's sessions placed elsewhere after
    # it, and the last documents find room by a reclaim (round robin's copies) or not at all.
    after = STEPS.index(next(step for step in STEPS if step.lose))
    assert all(replica != lost for r in routed[after:] for _, _, replica, _ in r.placed)
    if policy == "round_robin":
        assert sum(copy and not read for _, read, _, copy in placed) >= 2
        assert len(routed[-1].closed) >= 1
