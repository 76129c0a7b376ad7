"""A router cut off from the session store while other routers reach it fails Serve's health
check; a store down for all, no peers, or a GCS that is down too fail nobody's
(`wim_service/serving/routing/store_reach.py`). Routers over fake replicas and an in-process
store; the peers' reaches in memory in place of the GCS; a clock the tests move."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.replicas import FakeClient
from wim_service.serving.errors import ServiceError
from wim_service.serving.routing import store_reach
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.routing.store_reach import (
    PROBE_EVERY_S,
    SERVE_FAILURES,
    SKEW_S,
    StoreCutOff,
    StoreReach,
    cut_off_alone,
    held,
)
from wim_service.serving.store import MemorySessionStore, StoredSession, StoreUnavailable
from wim_service.wim.errors import ErrorCode

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Board:
    """The routers' reaches, shared as the GCS's key-value store shares them; `down` is a GCS
    that does not answer."""

    def __init__(self) -> None:
        self.reaches: dict[str, float] = {}
        self.down = False

    def _answer(self) -> None:
        if self.down:
            raise TimeoutError("the GCS does not answer")

    async def publish(self, name: str, reached_at: float) -> None:
        self._answer()
        self.reaches[name] = reached_at

    async def others(self, name: str) -> dict[str, float]:
        self._answer()
        return {other: at for other, at in self.reaches.items() if other != name}

    async def withdraw(self, name: str) -> None:
        self._answer()
        self.reaches.pop(name, None)

    async def prune(self, before: float) -> None:
        self._answer()
        self.reaches = {name: at for name, at in self.reaches.items() if at >= before}


class Reachable(MemorySessionStore):
    """One router's way to the shared store: `cut` makes every call fail as a lost link does."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    async def get(self, session_id: str) -> StoredSession | None:
        if self.cut:
            raise StoreUnavailable("the session store (Redis) is unavailable: timed out")
        return await super().get(session_id)


def router(name: str, store: Reachable, board: Board, clock: Clock) -> WiMRouter:
    wim_router = WiMRouter(
        None,
        {"router": {}},
        client=FakeClient(),
        http_host="127.0.0.1",
        store=store,
        witnesses=board,
    )
    wim_router.reach.name = name
    wim_router.reach.clock = clock
    return wim_router


async def turn(clock: Clock, *routers: WiMRouter) -> None:
    """One probe interval: every router probes the store."""
    clock.now += PROBE_EVERY_S
    for each in routers:
        await each.reach.probe()


def run(test: object) -> None:
    asyncio.run(test())  # type: ignore[operator]


def test_a_router_cut_off_alone_fails_its_health_check_once_a_peer_reaches_the_store() -> None:
    async def scenario() -> None:
        clock, board = Clock(), Board()
        cut, peer = Reachable(), Reachable()
        one, other = router("r1", cut, board, clock), router("r2", peer, board, clock)
        await turn(clock, one, other)
        await one.reach.check()
        cut.cut = True
        # The peer reaching the store as this router's probes begin to fail proves nothing.
        await turn(clock, one, other)
        await one.reach.check()
        failing_since = one.reach.failing_since
        assert failing_since is not None
        while clock.now <= failing_since + SKEW_S:
            await turn(clock, one, other)
        for failed in range(1, SERVE_FAILURES + 1):
            with pytest.raises(StoreCutOff, match="other routers reach it"):
                await one.reach.check()
            assert one.reach.failed_checks == failed
        await other.reach.check()
        # The link back: healthy at the next probe.
        cut.cut = False
        await turn(clock, one, other)
        await one.reach.check()
        assert one.reach.failed_checks == 0

    run(scenario)


def test_a_store_down_for_every_router_fails_no_health_check() -> None:
    async def scenario() -> None:
        clock, board = Clock(), Board()
        stores = [Reachable(), Reachable()]
        routers = [router(f"r{i}", s, board, clock) for i, s in enumerate(stores)]
        await turn(clock, *routers)
        # The second router's last reach comes one probe after the first's.
        stores[0].cut = True
        await turn(clock, *routers)
        stores[1].cut = True
        for _ in range(10):
            await turn(clock, *routers)
            for each in routers:
                await each.reach.check()

    run(scenario)


def test_a_router_started_while_cut_off_fails_its_first_check() -> None:
    """Serve's first health check of a new replica probes the store itself, and waits for the
    peers' next reach."""

    async def scenario() -> None:
        clock, board = Clock(), Board()
        peer = router("r2", Reachable(), board, clock)
        await turn(clock, peer)
        store = Reachable()
        store.cut = True
        new = router("r1", store, board, clock)

        async def peer_reaches_later() -> None:
            await asyncio.sleep(0.3)
            await turn(clock, peer)
            await turn(clock, peer)

        later = asyncio.create_task(peer_reaches_later())
        with pytest.raises(StoreCutOff):
            await new.reach.check()
        await later

    run(scenario)


def unavailable() -> ServiceError:
    return ServiceError(ErrorCode.UNAVAILABLE, "tenant limits are unavailable for a moment")


def test_nothing_to_judge_by_fails_nobody() -> None:
    """No peer, a peer gone long ago, or a GCS that does not answer either: no failed check,
    and a request refused at once."""

    async def scenario() -> None:
        clock, board = Clock(), Board()
        store = Reachable()
        alone = router("r1", store, board, clock)
        await turn(clock, alone)
        store.cut = True
        for _ in range(10):
            await turn(clock, alone)
        await alone.reach.check()

        async def refused() -> int:
            raise unavailable()

        with pytest.raises(ServiceError):
            await asyncio.wait_for(held(alone.reach, refused), 1)
        board.reaches["gone"] = clock.now - 20
        await alone.reach.check()
        board.reaches["r2"] = clock.now
        board.down = True
        await alone.reach.check()

    run(scenario)


def test_a_request_on_a_router_cut_off_alone_waits_until_serve_takes_it_out() -> None:
    """Its 503 comes once Serve's checks have failed `SERVE_FAILURES` times; a request whose
    store comes back meanwhile is tried again and answered."""

    async def scenario() -> None:
        clock, board = Clock(), Board()
        cut, peer = Reachable(), Reachable()
        one, other = router("r1", cut, board, clock), router("r2", peer, board, clock)
        await turn(clock, one, other)
        cut.cut = True
        await turn(clock, one, other)
        calls: list[int] = []

        async def refused() -> int:
            calls.append(1)
            raise unavailable()

        # Not judged alone yet (the peer's reach is not past the clocks' skew): 503 at once.
        with pytest.raises(ServiceError):
            await held(one.reach, refused)
        for _ in range(2):
            await turn(clock, one, other)

        async def refused() -> int:
            calls.append(1)
            raise unavailable()

        request = asyncio.create_task(held(one.reach, refused))
        await asyncio.sleep(0.3)
        for _ in range(SERVE_FAILURES):
            await asyncio.sleep(0.3)
            assert not request.done()
            with pytest.raises(StoreCutOff):
                await one.reach.check()
        with pytest.raises(ServiceError):
            await request
        assert len(calls) == 2

        async def answered() -> int:
            calls.append(1)
            if cut.cut:
                raise unavailable()
            return 200

        one.reach.failed_checks = 0
        request = asyncio.create_task(held(one.reach, answered))
        await asyncio.sleep(0.3)
        cut.cut = False
        await turn(clock, one, other)
        assert await request == 200

    run(scenario)


def test_a_router_withdraws_its_reach_and_prunes_the_long_gone() -> None:
    async def scenario() -> None:
        clock, board = Clock(), Board()
        board.reaches["killed"] = clock.now - 2 * store_reach.STALE_S
        leaving = router("r1", Reachable(), board, clock)
        leaving.reach.start()
        while "r1" not in board.reaches:
            await asyncio.sleep(0.01)
        assert set(board.reaches) == {"r1"}
        await leaving.reach.withdraw()
        assert board.reaches == {}

    run(scenario)


def test_a_probe_answered_as_the_router_stops_ends_the_probing() -> None:
    """The probe's answer and the stop's cancel come in the same turn of the loop. Python
    3.11's `asyncio.wait_for` then returned the answer and lost the cancel: the probes ran on
    every second for good, and a loop's close waited on them (a test run hung 600 s)."""

    async def scenario() -> None:
        answer = asyncio.get_running_loop().create_future()
        reach = StoreReach("r1", lambda: answer, Board())
        reach.start()
        while not reach.probed:
            await asyncio.sleep(0)
        answer.set_result(None)
        reach.stop()
        watching = reach._watching
        assert watching is not None
        await asyncio.wait({watching}, timeout=3 * PROBE_EVERY_S)
        assert watching.cancelled()

    run(scenario)


@pytest.mark.parametrize(
    ("others", "alone"),
    [
        ({"r2": 100.0 + SKEW_S + 0.5}, True),
        ({"r2": 100.0 + SKEW_S - 0.5}, False),  # within the clocks' skew: down for all
        ({"r2": 90.0}, False),  # the peer stopped reaching it first
        ({}, False),
    ],
)
def test_cut_off_alone(others: dict[str, float], alone: bool) -> None:
    assert cut_off_alone(100.0, others, SKEW_S) is alone
