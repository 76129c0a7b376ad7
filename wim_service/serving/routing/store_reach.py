"""Whether this router is cut off from the session store alone, for Serve's health check.

A router that cannot reach the session store (its tenant limits, sessions and bindings live
there) refuses every request with a 503; Serve's proxies keep sending it requests all the
same, since Serve sees the replica alive. When the other routers reach the store meanwhile,
this router fails Serve's health check, so that Serve takes it out of its proxies' rotation
and starts it again (where it fails its first check until the store is back). When no router
reaches the store, it is down for all: every router stays in rotation, holding requests for
the store's `outage_wait_s` and then answering 503, since a restart would mend nothing.

A router cut off from the store cannot read anything the others write there, so each router
says when it last reached the store in the Ray GCS's key-value store instead, which a router
cut off from the store alone still reaches (`GcsWitnesses`). The verdict compares a peer's
last reach with this router's own: a peer that reached the store `cut_off_s` after this
router last did has seen the store up while this router could not; a store down for all
stops every router's reaches within one probe of each other, so it never passes that margin.
No peers, or the GCS unreachable too, tell nothing: then the router stays healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from wim_service.serving.config import StoreConfig
from wim_service.serving.store import SessionStore

logger = logging.getLogger(__name__)

# The session the store is probed with: no session has this id.
PROBE_ID = "store-reach-probe"
# A router probes the store this often, and says so to its peers when it reached it.
PROBE_EVERY_S = 1.0
# A probe that takes longer has not reached the store (the store's own calls wait up to its
# `outage_wait_s` for a store that refuses or does not answer).
PROBE_TIMEOUT_S = 2.0
# A peer that reached the store this long after this router last did shows that the store
# was up while this router could not reach it. Several probes, so that a store down for all
# (every router's last reach within one probe of the others') is never taken for it.
CUT_OFF_S = 5.0
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
        return await asyncio.wait_for(
            call(*args, namespace=self.NAMESPACE, timeout=GCS_TIMEOUT_S), GCS_TIMEOUT_S
        )

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


def cut_off_alone(
    reached_at: float | None, others: Mapping[str, float], now: float, cut_off_s: float
) -> bool:
    """Whether a peer reached the store `cut_off_s` after this router last did (`reached_at`)
    and within the last `cut_off_s`; a router that never reached it (just started) is judged
    by the peers' reaches within the last `cut_off_s` alone."""
    since = now - cut_off_s if reached_at is None else max(reached_at + cut_off_s, now - cut_off_s)
    return any(at > since for at in others.values())


class StoreReach:
    """This router's probes of the store (`probe`, a cheap store call) every `PROBE_EVERY_S`,
    told to its peers through `witnesses`; `check` is Serve's health check."""

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
        self.reached_at: float | None = None  # this router's last reach of the store
        self.probed = False
        self.reaching = False  # whether the last probe reached it
        self._watching: asyncio.Task[None] | None = None

    async def probe(self) -> bool:
        """Probe the store once; a reach is told to the peers. Whether it was reached."""
        self.probed = True
        try:
            await asyncio.wait_for(self._probe(), PROBE_TIMEOUT_S)
        except Exception as exc:  # any failure is a store this router does not reach
            logger.debug("session store probe failed: %s", exc)
            self.reaching = False
            return False
        self.reaching, self.reached_at = True, self.clock()
        with contextlib.suppress(Exception):  # a GCS that is down: the peers learn later
            await self.witnesses.publish(self.name, self.reached_at)
        return True

    async def check(self) -> None:
        """Raise `StoreCutOff` if the last probe did not reach the store and a peer's did, as
        `cut_off_alone` judges; a router not yet probed (Serve's first check) probes first."""
        reached = await self.probe() if not self.probed else self.reaching
        if reached:
            return
        try:
            others = await self.witnesses.others(self.name)
        except Exception as exc:  # the GCS is unreachable too: nothing to judge by
            logger.debug("the peers' store reaches are unknown: %s", exc)
            return
        if cut_off_alone(self.reached_at, others, self.clock(), CUT_OFF_S):
            last = (
                "never"
                if self.reached_at is None
                else f"{self.clock() - self.reached_at:.0f} s ago"
            )
            raise StoreCutOff(
                f"router {self.name} last reached the session store {last}; other routers reach it"
            )

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

    async def stop(self) -> None:
        """Stop probing and withdraw this router's reach: it is nobody's witness any more."""
        if self._watching is not None:
            self._watching.cancel()
        with contextlib.suppress(Exception):
            await self.witnesses.withdraw(self.name)


def store_reach(
    name: str, store: SessionStore, config: StoreConfig, witnesses: Witnesses | None
) -> StoreReach:
    """Router `name`'s reach of `store` (`config`), told through `witnesses` (by default the
    GCS's, for a Redis store in a Serve replica)."""
    witnesses = witnesses or store_witnesses(config, name)
    return StoreReach(name, lambda: store.get(PROBE_ID), witnesses)
