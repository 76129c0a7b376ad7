"""One scripted scenario through the live router (over scripted fake replicas) and through
`wim sim`: both place and book through the same ledger and keep the same book of copies, so
they must make the same placements, open the same copies and reclaim the same ones, step by
step.

The scenario: two documents opened at once, a burst of queries on the hot one (each takes a
turn of round robin: copies open on the replicas without it), a query on the other, then three
new documents as the session slots fill: the second finds no room until the idle copies (of
both documents) are reclaimed. Round robin places by turns and slots alone, so the two
sides' different engine timings cannot part them; `expected_wait` weighs their backlogs, which
the simulator computes from its engines. A replica lost is not in it: the simulator loses none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fakes.fake_service import ScriptedClient, ScriptedReplica
from tests.fakes.profile import PROFILE
from tests.sim.test_sim import doc_row, document_trace
from wim_service.placement.ledger import Booking, Ledger
from wim_service.placement.state import Work
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoredSession
from wim_service.sim.replay import Replay
from wim_service.sim.settings import SimSettings
from wim_service.wim.options import WiMOptions

REPLICAS = ("r00", "r01", "r02")
SLOTS = 2  # session slots per replica: copies and sessions alike
TEXT = "The night gate code is 4417. Ask Marta at the harbour office about it. " * 40
QUERY = "What is the night gate code?"
# (time, document, queries) in order: opened, then queried.
STEPS = [
    (0.0, ["hot", "cold"], ["hot", "hot", "hot", "cold"]),
    (1000.0, ["c", "d", "e"], ["c", "d", "e"]),
]

Placed = tuple[str | None, bool, str, bool]  # (document, a read, replica, a copy opened)
Closed = list[tuple[str, str]]  # (document, replica) of each copy a reclaim closed


def recording(ledger: Ledger, placed: list[Placed]) -> None:
    """Record every placement `ledger` makes."""
    place = ledger.place

    def recorded(work: Work, **kw: Any) -> Booking:
        booking = place(work, **kw)
        placement = booking.placement
        placed.append((work.document, work.reads_only, placement.replica, placement.open_copy))
        return booking

    ledger.place = recorded  # type: ignore[method-assign]


def held(holders: dict[str, Any]) -> set[tuple[str, str]]:
    return {(document, name) for name, documents in holders.items() for document in documents}


async def through_the_router() -> tuple[list[Placed], Closed]:
    replicas = [ScriptedReplica(name) for name in REPLICAS]
    for replica in replicas:
        replica.max_sessions = SLOTS
    settings = {
        "replica_wait_s": 0,
        "load_poll_interval_s": 3600,
        "placement": "round_robin",
        "copy_idle_s": 10_000.0,
    }
    router = WiMRouter(
        None, {"router": settings}, client=ScriptedClient(*replicas), http_host="127.0.0.1"
    )
    await router.fleet.refresh_loads()
    placed: list[Placed] = []
    recording(router.fleet.ledger, placed)
    closed: Closed = []
    copies = router.dispatcher.copies
    reclaim = copies.reclaim

    async def reclaimed(*args: Any) -> int:
        before = held({r.name: r.documents for r in replicas})
        count = await reclaim(*args)
        closed.extend(sorted(before - held({r.name: r.documents for r in replicas})))
        return count

    # Passed in explicitly: to the dispatcher's placements at each call, to the failover's
    # (which reads new documents) when it was made.
    copies.reclaim = router.dispatcher.failover.reclaim = reclaimed  # type: ignore[method-assign]
    for _, opened, queried in STEPS:
        for document in opened:
            session = StoredSession(document, WiMOptions(), ttl_s=10_000.0)
            await router.dispatcher.open_document(session, TEXT)
        for document in queried:
            record = await router.documents.get(document)
            items = [
                item
                async for item in router.dispatcher.job(
                    document, QUERY, WiMOptions(), record=record
                )
            ]
            assert items[-1][1].type == "done"
    return placed, closed


def through_the_simulator(tmp_path: Path) -> tuple[list[Placed], Closed]:
    tokens = len(TEXT) // 4  # as the fake replicas read it
    rows = [
        doc_row(t, document, wim=True, tokens=tokens)
        for t, _, queried in STEPS
        for document in queried
    ]
    settings = SimSettings(slots=SLOTS, copy_idle_s=10_000.0)
    replay = Replay(document_trace(rows, tmp_path), "round_robin", len(REPLICAS), PROFILE, settings)
    placed: list[Placed] = []
    recording(replay.ledger, placed)
    closed: Closed = []
    reclaim = replay._reclaim

    def reclaimed(now: float) -> int:
        before = held({e.name: e.copies for e in replay.engines})
        count = reclaim(now)
        closed.extend(sorted(before - held({e.name: e.copies for e in replay.engines})))
        return count

    replay._reclaim = reclaimed  # type: ignore[method-assign]
    result = replay.run()
    assert len(result.outcomes) == len(rows) and result.copies_reclaimed == len(closed)
    return placed, closed


async def test_the_router_and_the_simulator_place_one_scenario_alike(tmp_path: Path) -> None:
    routed, routed_closed = await through_the_router()
    simulated, simulated_closed = through_the_simulator(tmp_path)
    assert routed == simulated  # every placement, in order: replica, read or query, copy
    assert routed_closed == simulated_closed  # the copies each reclaim closed
    # The scenario does what it is for: copies of the hot document opened, then reclaimed.
    assert sum(copy and not read for _, read, _, copy in routed) >= 2
    assert len(routed_closed) >= 2
