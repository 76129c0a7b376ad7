"""Whether this router is cut off from the session store alone, for Serve's health check.

A router that cannot reach the session store (its tenant limits, sessions and bindings live
there) can only answer 503, and Serve's proxies keep sending it requests all the same, since
Serve sees the replica alive: a client's every retry could land on it. When the other routers
reach the store meanwhile, this router fails Serve's health check, so that Serve takes it out
of its proxies' rotation and starts it again (where it fails its first check until the store
is back), and a request that could not reach the store waits on it until then (`hold`): its
503 comes once the client's retry reaches another router, and the held requests make Serve's
proxies prefer the other routers meanwhile. When no router reaches the store it is down for
all: every router stays in rotation (the store's `outage_wait_s` holds the requests), since a
restart would mend nothing.

A router cut off from the store cannot read anything the others write there, so each router
says when it last reached the store in the Ray GCS's key-value store instead, which a router
cut off from the store alone still reaches (`GcsWitnesses`). A peer that reached the store
after this router's probes began to fail saw it up while this router could not; a store down
for all ends every router's reaches before their probes fail. No peers, or the GCS
unreachable too, tell nothing: then the router stays healthy and holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from wim_service.serving.config import StoreConfig
from wim_service.serving.errors import ServiceError
from wim_service.serving.store import SessionStore
from wim_service.wim.errors import ErrorCode

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The session the store is probed with: no session has this id.
PROBE_ID = "store-reach-probe"
# A router probes the store this often, and says so to its peers when it reached it.
PROBE_EVERY_S = 1.0
# A probe that takes longer has not reached the store (the store's own calls wait up to its
# `outage_wait_s` for a store that refuses or does not answer).
PROBE_TIMEOUT_S = 2.0
# The hosts' clocks agree within this: a peer's reach counts as later than this router's
# first failed probe only past it.
SKEW_S = 1.0
# Serve's controller takes a replica out of rotation after this many failed health checks in
# a row (its REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD).
SERVE_FAILURES = 3
# A request held on a router cut off alone waits at most this long, and asks this often.
HOLD_S = 30.0
HOLD_POLL_S = 0.25
# Serve's first check of a new replica that cannot reach the store waits this long for a
# verdict (within the router's `health_check_timeout_s`, 5 s in the serve configs).
FIRST_CHECK_S = 3.0
# Each call to the GCS's key-value store is given up after this long (a GCS that is down).
GCS_TIMEOUT_S = 1.0
# A router's reach this old is a router gone without withdrawing it (killed): its key is
# deleted when a router starts.
STALE_S = 3600.0


class StoreCutOff(RuntimeError):
    """This router cannot reach the session store while its peers can."""


class Witnesses(Protocol):
    """Where the routers say when each last reached the store, read by the others."""

    async def publish(self, name: str, reached_at: float) -> None: ...

    async def others(self, name: str) -> dict[str, float]:
        """Every other router's last reach (wall-clock seconds), by name."""
        ...

    async def withdraw(self, name: str) -> None: ...

    async def prune(self, before: float) -> None:
        """Forget the reaches older than `before`."""
        ...


class NoWitnesses:
    """A router with no peers (in a process of its own, outside Ray): never cut off alone."""

    async def publish(self, name: str, reached_at: float) -> None:
        return None

    async def others(self, name: str) -> dict[str, float]:
        return {}

    async def withdraw(self, name: str) -> None:
        return None

    async def prune(self, before: float) -> None:
        return None


class GcsWitnesses:
    """The routers' last reaches in the Ray GCS's key-value store, one key per router replica
    under `prefix` (a deployment's routers share it). A GCS call that fails or takes longer
    than `GCS_TIMEOUT_S` tells nothing."""

    NAMESPACE = b"wim"

    def __init__(self, gcs: Any, prefix: str) -> None:
        self.gcs = gcs  # the worker's `ray._raylet.GcsClient`
        self.prefix = prefix

    def _key(self, name: str) -> bytes:
        return f"{self.prefix}{name}".encode()

    async def _call(self, call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        async with asyncio.timeout(GCS_TIMEOUT_S):
            return await call(*args, namespace=self.NAMESPACE, timeout=GCS_TIMEOUT_S)

    async def publish(self, name: str, reached_at: float) -> None:
        value = repr(reached_at).encode()
        await self._call(self.gcs.async_internal_kv_put, self._key(name), value, True)

    async def others(self, name: str) -> dict[str, float]:
        keys = await self._call(self.gcs.async_internal_kv_keys, self.prefix.encode())
        keys = [key for key in keys if key != self._key(name)]
        if not keys:
            return {}
        values = await self._call(self.gcs.async_internal_kv_multi_get, keys)
        start = len(self.prefix)
        return {key.decode()[start:]: float(value) for key, value in values.items()}

    async def withdraw(self, name: str) -> None:
        await self._call(self.gcs.async_internal_kv_del, self._key(name), False)

    async def prune(self, before: float) -> None:
        """Delete the reaches older than `before` (routers gone without withdrawing them)."""
        for name, at in (await self.others("")).items():
            if at < before:
                await self.withdraw(name)


def store_witnesses(config: StoreConfig, name: str) -> Witnesses:
    """The GCS's witnesses for the routers of one Redis store (by its key prefix); none for a
    store in the router's process, or a router outside Serve (`name` "local")."""
    if config.backend != "redis" or name == "local":
        return NoWitnesses()
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    gcs = internal_kv_get_gcs_client()  # type: ignore[no-untyped-call]
    return NoWitnesses() if gcs is None else GcsWitnesses(gcs, f"store_reach:{config.key_prefix}")


def cut_off_alone(failing_since: float, others: Mapping[str, float], skew_s: float) -> bool:
    """Whether a peer reached the store after this router's probes began to fail
    (`failing_since`), by more than the hosts' clocks may differ (`skew_s`)."""
    return any(at > failing_since + skew_s for at in others.values())


class StoreReach:
    """This router's probes of the store (`probe`, a cheap store call) every `PROBE_EVERY_S`,
    told to its peers through `witnesses`; `check` is Serve's health check and `hold` what a
    request that could not reach the store waits for."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[object]],
        witnesses: Witnesses,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self._probe = probe
        self.witnesses = witnesses
        self.clock = clock
        self.probed = False
        # When the probe that began the current run of failed probes started (None: the last
        # probe reached the store).
        self.failing_since: float | None = None
        self.failed_checks = 0  # Serve's health checks failed in a row
        self._watching: asyncio.Task[None] | None = None

    async def probe(self) -> bool:
        """Probe the store once; a reach is told to the peers. Whether it was reached."""
        self.probed, started = True, self.clock()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self._probe()
        except Exception as exc:  # any failure is a store this router does not reach
            logger.debug("session store probe failed: %s", exc)
            if self.failing_since is None:
                self.failing_since = started
            return False
        self.failing_since = None
        with contextlib.suppress(Exception):  # a GCS that is down: the peers learn later
            await self.witnesses.publish(self.name, self.clock())
        return True

    async def alone(self) -> bool:
        """Whether this router is cut off from the store alone (`cut_off_alone`); a router
        not yet probed (Serve's first check) probes first."""
        if not self.probed:
            await self.probe()
        if self.failing_since is None:
            return False
        try:
            others = await self.witnesses.others(self.name)
        except Exception as exc:  # the GCS is unreachable too: nothing to judge by
            logger.debug("the peers' store reaches are unknown: %s", exc)
            return False
        return cut_off_alone(self.failing_since, others, SKEW_S)

    async def check(self) -> None:
        """Serve's health check: `StoreCutOff` while this router is cut off alone. Serve's
        first check of a new replica that cannot reach the store waits up to `FIRST_CHECK_S`
        for its peers to show the store up, so that it does not join the rotation."""
        polls = int(FIRST_CHECK_S / HOLD_POLL_S) if not self.probed else 0
        alone = await self.alone()
        while not alone and self.failing_since is not None and polls > 0:
            await asyncio.sleep(HOLD_POLL_S)
            alone, polls = await self.alone(), polls - 1
        if not alone:
            self.failed_checks = 0
            return
        self.failed_checks += 1
        since = self.clock() - (self.failing_since or 0.0)
        raise StoreCutOff(
            f"router {self.name} has not reached the session store for {since:.0f} s; "
            "other routers reach it"
        )

    async def hold(self) -> bool:
        """What a request that could not reach the store waits for when this router is cut
        off alone: until Serve has taken it out of its proxies' rotation (`SERVE_FAILURES`
        failed checks), so that the client's retry reaches another router, or until the store
        is reached again; at most `HOLD_S`. A router not judged alone (the store down for all,
        no peers, the GCS down too) holds nothing. Whether the store is reached again (the
        request may try again)."""
        if not await self.alone():
            return False
        deadline = time.monotonic() + HOLD_S
        while self.failed_checks < SERVE_FAILURES and time.monotonic() < deadline:
            if self.failing_since is None:
                return True
            await asyncio.sleep(HOLD_POLL_S)
        return self.failing_since is None

    def start(self) -> None:
        """Probe every `PROBE_EVERY_S` on the running loop until `stop`."""
        if self._watching is None or self._watching.done():
            self._watching = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        with contextlib.suppress(Exception):  # the GCS is down: the next start prunes
            await self.witnesses.prune(self.clock() - STALE_S)
        while True:
            await self.probe()
            await asyncio.sleep(PROBE_EVERY_S)

    def stop(self) -> None:
        """Stop probing."""
        if self._watching is not None:
            self._watching.cancel()

    async def withdraw(self) -> None:
        """Stop probing and withdraw this router's reach: it is nobody's witness any more."""
        self.stop()
        with contextlib.suppress(Exception):
            await self.witnesses.withdraw(self.name)


def store_reach(
    name: str, store: SessionStore, config: StoreConfig, witnesses: Witnesses | None
) -> StoreReach:
    """Router `name`'s reach of `store` (`config`), told through `witnesses` (by default the
    GCS's, for a Redis store in a Serve replica)."""
    witnesses = witnesses or store_witnesses(config, name)
    return StoreReach(name, lambda: store.get(PROBE_ID), witnesses)


async def held(reach: StoreReach, call: Callable[[], Awaitable[T]]) -> T:
    """`call`; if it found the store unavailable while this router is cut off from it alone,
    held (`StoreReach.hold`) and tried once more if the store is reached again."""
    try:
        return await call()
    except ServiceError as exc:
        if exc.code != ErrorCode.UNAVAILABLE or not await reach.hold():
            raise
    return await call()
