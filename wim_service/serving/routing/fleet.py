"""The engine replicas as the router sees them: their loads, polled, and where work goes.

`ReplicaFleet` polls every live replica's load into the ledger (`placement/ledger.py`: the
reports as taken, and the work placed since), places work by the configured policy
(`RouterConfig.placement`, waiting a while when no replica is up, closing spare copies it is
given a `reclaim` for before it refuses), and marks replicas lost. With `expected_wait` it also
admits arrivals cheapest first while the fleet is short (`admit`, `placement/admission.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from wim_service.engine.kv_transfer.documents import store_url
from wim_service.placement.admission import AdmissionRule, cheapest_first
from wim_service.placement.ledger import Booking, Ledger
from wim_service.placement.no_room import NoRoomSteps, Step
from wim_service.placement.policy import make_policy
from wim_service.placement.polls import FRESH_LOADS_S
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import NoRoom, Work
from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.observability.metrics import WiMMetrics
from wim_service.serving.replica.client import ReplicaClient
from wim_service.serving.replica.contracts import ReplicaLoad
from wim_service.serving.replica.watch import WatchedClient
from wim_service.serving.routing.bindings import BindResult
from wim_service.serving.routing.recent import Recent
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)

# A call for a replica's load fails after this long (the replica is skipped until it answers).
LOAD_TIMEOUT_S = 10.0
# A poll waits this long for the reports; a replica that has not answered by then keeps its
# last report, and its call goes on for the next poll. Waiting out LOAD_TIMEOUT_S instead
# held every replica's report back while one node was gone: for LOAD_TIMEOUT_S the router
# placed work on loads that no longer counted what had ended, and a failover was refused 429
# (docs/reliability.md, "A failover refused on phantom bookings").
POLL_WAIT_S = 1.0

# Closes the spare copies of hot documents to make room, the number closed
# (`DocumentCopies.reclaim`): passed to `ReplicaFleet.place` by whoever keeps the copies.
Reclaim = Callable[[], Awaitable[int]]


class ReplicaFleet:
    def __init__(self, client: ReplicaClient, config: RouterConfig, metrics: WiMMetrics) -> None:
        self.client = client
        # The calls of jobs, reads and closes go through `watched`: those open on a replica
        # taken for lost end (`_condemn_silent`). Load calls do not: a replica that answers
        # one again is back.
        self.watched = WatchedClient(client)
        self.config = config
        self.metrics = metrics
        path = Path(config.cost_profile) if config.cost_profile else None
        restores = config.restore_copies
        if restores is None:
            restores = store_url() is not None
        profile = EngineProfile.load(path).for_store(restores)
        policy = make_policy(config.placement, profile, max_copies=config.max_copies)
        self.ledger = Ledger(policy, profile)
        # Each replica's load call, until it answers (one at a time per replica), with the
        # ledger's mark when it was asked: the report covers the work booked before.
        self._asking: dict[str, asyncio.Task[tuple[int, ReplicaLoad]]] = {}
        # The loads asked again for a decision that must not rest on a poll's (a refusal, a
        # copy's read), at most once per FRESH_LOADS_S however many decide at once.
        self.fresh_loads = Recent(self.refresh_loads, FRESH_LOADS_S)
        self._dtypes_seen: set[str] = set()  # the engines' dtypes checked against the profile
        # Cheapest-first admission, `expected_wait`'s unless turned off; its books are this
        # router's arrivals and answers, at this router's clock.
        rule = AdmissionRule(
            config.cheapest_first_window_s,
            config.cheapest_first_short_s,
            config.cheapest_first_slack,
            config.cheapest_first_window_arrivals,
            config.cheapest_first_short_arrivals,
        )
        self.admission = cheapest_first(
            policy.name, config.cheapest_first, rule, time.monotonic, config.request_timeout_s
        )
        # Sessions opened as their first query was admitted (`admit`'s `opens`), with that
        # query's cost and when: the query is not asked again (`first_query`).
        self._opened: dict[str, tuple[float, float]] = {}

    async def refresh_loads(self) -> None:
        replicas = sorted(await self.client.live_replicas())
        for replica in set(self._asking) - set(replicas):
            self._asking.pop(replica).cancel()
        asking = {r: self._asking.get(r) or self._ask(r) for r in replicas}
        self._asking.update(asking)
        if asking:
            await asyncio.wait(asking.values(), timeout=POLL_WAIT_S)
        loads, covers = [], {}
        for replica, task in asking.items():
            if not task.done():
                continue
            if self._asking.get(replica) is task:
                del self._asking[replica]
            if not task.cancelled() and task.exception() is None:
                covers[replica], load = task.result()
                loads.append(load)
            else:
                error = "cancelled" if task.cancelled() else repr(task.exception())
                logger.warning("engine replica %s did not report its load: %s", replica, error)
        self.ledger.take_reports(replicas, [load.report() for load in loads], covers)
        self._condemn_silent()
        self._export(loads)
        self._check_dtypes(loads)

    def _condemn_silent(self) -> None:
        """Take a replica that has answered no load call for `replica_silence_s` for lost, and
        end the calls open on it (`WatchedClient.condemn`), once per poll while it is silent.

        Ray says that an actor died only through the GCS: with the GCS down, calls to a replica
        whose node is gone wait for it, and Serve keeps routing to it. A replica that answers
        a load call again is placed on as before."""
        now = time.monotonic()
        for replica, reported in self.ledger.reported_at.items():
            silent = now - reported
            if silent <= self.config.replica_silence_s:
                continue
            load = self.ledger.load(replica)
            if load is not None and load.healthy:
                logger.warning(
                    "engine replica %s answered no load call for %.1f s; taking it for lost",
                    replica,
                    silent,
                )
                # Not counted here: each job it ends counts its failover (`replica_silent`).
                self.ledger.lose(replica, silent=True)
            self.watched.condemn(replica)

    def _check_dtypes(self, loads: list[ReplicaLoad]) -> None:
        """Warn, once per dtype, of engines that run in another dtype than the cost profile
        was measured in: placement and copies weigh waits and reads in the profile's seconds,
        and a dtype moves a CPU engine's speed severalfold."""
        for load in loads:
            if not load.dtype or load.dtype in self._dtypes_seen:
                continue
            self._dtypes_seen.add(load.dtype)
            mismatch = self.ledger.profile.dtype_mismatch(load.dtype)
            if mismatch is not None:
                logger.warning(
                    "%s (replica %s): the router's wait estimates are in the profile's "
                    "seconds, not the engines'; set args.router.cost_profile to a profile "
                    "measured where the engines run (wim calibrate)",
                    mismatch,
                    load.replica,
                )

    def _ask(self, replica: str) -> asyncio.Task[tuple[int, ReplicaLoad]]:
        return asyncio.get_running_loop().create_task(self._load_of(replica, self.ledger.mark()))

    def _export(self, loads: list[ReplicaLoad]) -> None:
        """The replicas' reports, and the admission's water level and pace, as the router's
        gauges."""
        if self.admission is not None:
            self.metrics.admission_level.set(self.admission.level(self.admission.clock()).high)
            pace = self.admission.pace()
            self.metrics.admission_pace.set(math.nan if pace is None else pace)
        self.metrics.sessions_active.clear()
        self.metrics.resident_kv_tokens.clear()
        self.metrics.kv_reserved_blocks.clear()
        self.metrics.replica_draining.clear()
        for load in loads:
            self.metrics.sessions_active.labels(load.replica).set(load.sessions)
            self.metrics.resident_kv_tokens.labels(load.replica).set(load.resident_kv_tokens)
            self.metrics.kv_reserved_blocks.labels(load.replica).set(load.reserved_blocks)
            # At 0 while it is not: "none draining" reads 0 on a dashboard, not "No data".
            self.metrics.replica_draining.labels(load.replica).set(0)
        # A replica that left the routing set while calls of ours still run on it is draining:
        # Serve lets those calls finish before it stops the replica.
        for replica, calls in self.client.in_flight.items():
            if calls and replica not in self.ledger.live:
                self.metrics.replica_draining.labels(replica).set(1)

    async def _load_of(self, replica: str, mark: int) -> tuple[int, ReplicaLoad]:
        async with asyncio.timeout(LOAD_TIMEOUT_S):
            load = await self.client.replica(replica).load()
        return mark, ReplicaLoad.model_validate(load)

    def stop(self) -> None:
        """End the load calls still waiting for an answer."""
        for task in self._asking.values():
            task.cancel()
        self._asking.clear()

    def ready(self) -> list[str]:
        return [load.replica for load in self.ledger.loads.values() if load.healthy]

    def session_capacity(self) -> int:
        """The sessions the replicas that take new ones admit at once (their `max_sessions`):
        what the tenants' fair shares divide."""
        return sum(
            load.max_sessions
            for load in self.ledger.loads.values()
            if load.healthy and not load.draining
        )

    async def place(
        self,
        session: str | None,
        work: Work,
        exclude: Collection[str] = (),
        holders: Collection[str] = (),
        *,
        reclaim: Reclaim | None = None,
    ) -> Booking:
        """Where `work` runs, by the policy, bound to `session` if given; waits a while for a
        first replica to come up. `holders` hold a copy of the work's document. With no room
        anywhere, the loads are asked again and `reclaim` (if given) closes spare copies
        before the work is refused, in the order `wim sim` follows (`NoRoomSteps`)."""
        deadline = time.monotonic() + self.config.replica_wait_s
        steps = NoRoomSteps(reclaims=reclaim is not None)
        while True:
            try:
                return self.ledger.place(work, session=session, exclude=exclude, holders=holders)
            except NoRoom as exc:
                step = steps.after(exc.replicas, may_wait=time.monotonic() <= deadline)
                if step is Step.RECLAIM:
                    assert reclaim is not None
                    step = steps.reclaimed(await reclaim())
                if step is Step.REFUSE:
                    raise self._refusal(exc) from exc
            if step is Step.REFRESH:
                await self.fresh_loads.get()
                continue
            if step is Step.WAIT:  # no live replica (starting, or replacing a failed one)
                await asyncio.sleep(1.0)
            await self.refresh_loads()

    def admit(self, work: Work, *, opens: str | None = None) -> float | None:
        """Admit an arrival, `work` (a query, a one-shot job, a plain request), or refuse it
        (429 `overloaded`; 413 `too_long` if it would run past the deadline): its cost as
        admitted, None if no rule admits. `opens`: the session being opened as `work`, its
        first query, is admitted (`wim sim` opens a session with its first query); that
        query is then not asked again."""
        if self.admission is None:
            return None
        verdict = self.admission.admit(self.ledger, work)
        if verdict.too_long_s is not None:
            raise self._too_long(verdict.too_long_s, short=verdict.short)
        cost = verdict.cost
        if not verdict.admitted:
            self.metrics.admission_refused.labels(ErrorCode.OVERLOADED.value).inc()
            raise ServiceError(
                ErrorCode.OVERLOADED,
                "the engines are answering less than is asked and this request costs more "
                "engine time than most; retry later, or ask about a shorter document",
                self.config.retry_after_s,
            )
        if opens is not None:
            now = self.admission.clock()
            since = now - self.admission.rule.window_s  # past the books' window: forgotten
            self._opened = {s: held for s, held in self._opened.items() if held[1] >= since}
            self._opened[opens] = (cost, now)
        return cost

    def _too_long(self, seconds: float, *, short: bool) -> ServiceError:
        """The refusal of an arrival expected to take `seconds`, past the deadline: `413
        too_long`, or while the fleet is short (its pace partly its queues) `429 overloaded`
        with Retry-After."""
        code = ErrorCode.OVERLOADED if short else ErrorCode.TOO_LONG
        self.metrics.admission_refused.labels(code.value).inc()
        message = (
            f"this request would take about {seconds:.0f} s on the engines at the pace they "
            f"answer at, past the request deadline of {self.config.request_timeout_s:g} s; "
        )
        if short:
            message += "the engines are short of time now: retry later, or send a shorter one"
            return ServiceError(code, message, self.config.retry_after_s)
        return ServiceError(code, message + "send a shorter document or prompt")

    def first_query(self, session: str) -> float | None:
        """The cost a session's first query was admitted at as the session opened (None:
        not opened so, or asked for already)."""
        held = self._opened.pop(session, None)
        return None if held is None else held[0]

    def answered(self, cost: float | None, took_s: float | None = None) -> None:
        """Work admitted at `cost` was answered (None: no rule admitted it), in `took_s` on
        its engine if the replica measured it."""
        if self.admission is not None and cost is not None:
            self.admission.answered(cost, took_s)

    def refused_by_replica(self, code: str) -> None:
        """A replica refused a call with `code`: for want of room (its queue or its KV
        admission full, `overloaded`), the fleet is short, as when placement finds none."""
        if code == ErrorCode.OVERLOADED:
            self._short()

    def timed_out(self) -> None:
        """A job ran past the request deadline and was stopped: the fleet is short, as when
        placement finds no room (with KV to spare, overload queues work until it times out)."""
        self._short()

    def _short(self) -> None:
        if self.admission is not None:
            self.admission.fell_short()

    def _refusal(self, exc: NoRoom) -> ServiceError:
        """The error of work `place` refuses: every live replica full, or none live."""
        self.metrics.binding.labels(BindResult.REJECTED).inc()
        if exc.replicas:
            self._short()
            return ServiceError(
                ErrorCode.OVERLOADED,
                f"every engine replica's KV is committed ({exc}); retry later",
                self.config.retry_after_s,
            )
        return ServiceError(
            ErrorCode.UNAVAILABLE,
            "no engine replica is ready; retry later",
            self.config.retry_after_s,
        )

    def lost(self, replica: str, reason: str) -> None:
        """Count a failover off `replica` and stop placing sessions there."""
        self.metrics.failover.labels(reason).inc()
        self.ledger.lose(replica)
