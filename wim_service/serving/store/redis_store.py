"""`RedisSessionStore`: document sessions in Redis, shared by every router replica.

Per session (prefix `P`, default `wim:`):

* `P{id}:s`, a hash: options (JSON, sealed like the text), tenant, replica ("" = unbound),
  copies (replicas joined by commas), context_tokens, segments, kv_blocks, ttl_ms, expires_ms;
* `P{id}:d`, the document text (`DocumentCipher`: AES-GCM when a key is set);
* `P{id}:t`, a tombstone left by `delete`, for `tombstone_ttl_s`;
* `P{id}:c`, a sorted set of the leases of queries on its copies (`replica|lease`) by lease
  end, and in the hash `used:<replica>`, when a query last took or gave back one there;
* `Pexpiry`, a sorted set of session ids by expiry, for `sweep`.

Per tenant `T` (`serving/routing/quotas.py` counts its limits here):

* `Ptenant:T:requests`, a sorted set of request ids by time, the last `window_s`;
* `Ptenant:T:jobs`, a sorted set of running job ids by lease end;
* `Popening`, one sorted set of session reservations (`id|tenant`) by lease end.

Every read-check-write is one Lua script, so it is atomic against every other router, and
every expiry is judged by Redis' own clock (`TIME`), so routers with skewed clocks agree. A
session is expired at `expires_ms`; Redis drops its keys by TTL `expiry_grace_s` later, which
leaves a router time to `sweep` it and close its KV on the bound replica. The `{id}` hash tag
keeps one session's keys in one slot; the expiry index is one key, so use one Redis (with a
replica/Sentinel for failover), not a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from dataclasses import replace
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from wim_service.serving.config import StoreConfig
from wim_service.serving.store.base import (
    Holding,
    SessionExists,
    StoredSession,
    StoreUnavailable,
)
from wim_service.serving.store.cipher import DocumentCipher
from wim_service.serving.store.redis_scripts import PRELUDE, SCRIPTS
from wim_service.wim.options import WiMOptions

REDIS_URL_ENV = "WIM_REDIS_URL"

# Sessions a sweep takes at most (the next sweep takes the rest).
SWEEP_BATCH = 100

# The pauses between tries of a call Redis did not run, doubling: a restart is noticed within a
# second of Redis taking connections again, and a Redis that is down sees a few tries a second.
OUTAGE_FIRST_PAUSE_S = 0.1
OUTAGE_MAX_PAUSE_S = 1.0


class RedisSessionStore:
    def __init__(
        self, client: Redis, config: StoreConfig, cipher: DocumentCipher | None = None
    ) -> None:
        self.client = client
        self.config = config
        self.cipher = cipher or DocumentCipher(None)
        self._grace_ms = round(config.expiry_grace_s * 1000)
        self._scripts = {
            name: client.register_script(PRELUDE + body) for name, body in SCRIPTS.items()
        }

    @classmethod
    def from_env(cls, config: StoreConfig) -> RedisSessionStore:
        """Connect to `WIM_REDIS_URL`; encrypt documents with `WIM_STORE_ENCRYPTION_KEY` if set."""
        url = os.environ.get(REDIS_URL_ENV, "").strip()
        if not url:
            raise ValueError(f"the redis session store needs the Redis URL in env {REDIS_URL_ENV}")
        return cls(connect(url, config), config, DocumentCipher.from_env())

    # -- keys ------------------------------------------------------------------------------

    def _key(self, session_id: str, kind: str) -> str:
        return f"{self.config.key_prefix}{{{session_id}}}:{kind}"

    @property
    def _index(self) -> str:
        return f"{self.config.key_prefix}expiry"

    def _tenant_key(self, tenant: str, kind: str) -> str:
        return f"{self.config.key_prefix}tenant:{tenant}:{kind}"

    @property
    def _reservations(self) -> str:
        return f"{self.config.key_prefix}opening"

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """`script`'s result. A call Redis did not run (`not_run`) is tried again, backing off,
        for up to `outage_wait_s`: a Redis restarting comes back within it. Any other failure
        is not, since the script may have run."""
        deadline = time.monotonic() + self.config.outage_wait_s
        pause_s = OUTAGE_FIRST_PAUSE_S
        while True:
            try:
                return await self._run_once(script, keys, args)
            except StoreUnavailable as exc:
                left_s = deadline - time.monotonic()
                if left_s <= 0 or not not_run(exc.__cause__):
                    raise
            await asyncio.sleep(min(pause_s, left_s))
            pause_s = min(2 * pause_s, OUTAGE_MAX_PAUSE_S)

    async def _run_once(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[script](keys=keys, args=args)
        except (
            redis_errors.ConnectionError,  # refused, reset, still loading
            redis_errors.TimeoutError,
            redis_errors.ReadOnlyError,  # a replica that has not been promoted yet
            OSError,
        ) as exc:
            raise StoreUnavailable(f"the session store (Redis) is unavailable: {exc}") from exc
        except redis_errors.ResponseError as exc:
            if (state := passing_state(exc)) is None:
                raise  # a script's own error is a bug: 500 with its incident id
            raise StoreUnavailable(f"the session store (Redis) refused ({state}): {exc}") from exc

    # -- SessionStore ----------------------------------------------------------------------

    async def create(self, session: StoredSession, text: str) -> StoredSession:
        sid = session.session_id
        fields = {
            "options": self.cipher.seal_field(_options_aad(sid), session.options.model_dump_json()),
            "tenant": session.tenant,
            "replica": session.replica or "",
            "copies": ",".join(session.copies),
            "context_tokens": session.context_tokens,
            "segments": session.segments,
            "kv_blocks": session.kv_blocks,
        }
        expires_ms = await self._run(
            "create",
            [
                *(self._key(sid, kind) for kind in ("s", "d", "t")),
                self._index,
                self._reservations,
            ],
            [
                sid,
                self.cipher.seal(sid, text),
                round(session.ttl_s * 1000),
                self._grace_ms,
                _reservation(session),
                *(item for pair in fields.items() for item in pair),
            ],
        )
        if not expires_ms:
            raise SessionExists(sid)
        return replace(session, expires_at=expires_ms / 1000)

    async def get(self, session_id: str) -> StoredSession | None:
        flat = await self._run("get", [self._key(session_id, "s")], [])
        return self._session(session_id, flat) if flat else None

    async def text(self, session_id: str) -> str | None:
        value = await self._run(
            "text", [self._key(session_id, "s"), self._key(session_id, "d")], []
        )
        return self.cipher.open(session_id, value) if value is not None else None

    async def touch(self, session_id: str, hold_s: float = 0.0) -> float | None:
        expires_ms = await self._run(
            "touch",
            [self._key(session_id, "s"), self._key(session_id, "d"), self._index],
            [session_id, self._grace_ms, round(hold_s * 1000)],
        )
        return expires_ms / 1000 if expires_ms is not None else None

    async def holdings(self) -> list[Holding]:
        flat = await self._run("holdings", [self._index], [self.config.key_prefix])
        return [
            Holding(sid.decode(), replica.decode() or None, _copies(copies.decode()), t.decode())
            for sid, replica, copies, t in zip(
                flat[::4], flat[1::4], flat[2::4], flat[3::4], strict=True
            )
        ]

    async def rebind(
        self, session_id: str, expected: str | None, new: str | None, *, promote: bool = False
    ) -> bool:
        swapped = await self._run(
            "rebind", [self._key(session_id, "s")], [expected or "", new or "", int(promote)]
        )
        return bool(swapped)

    async def add_copy(
        self, session_id: str, replica: str, max_holders: int, tenant_slots: int | None = None
    ) -> bool:
        slots = "" if tenant_slots is None else tenant_slots
        added = await self._run(
            "add_copy",
            [self._key(session_id, "s"), self._index],
            [replica, max_holders, self.config.key_prefix, slots],
        )
        return bool(added)

    async def drop_copy(self, session_id: str, replica: str, idle_s: float | None = None) -> bool:
        idle_ms = "" if idle_s is None else round(idle_s * 1000)
        keys = [self._key(session_id, "s"), self._key(session_id, "c")]
        return bool(await self._run("drop_copy", keys, [replica, idle_ms]))

    async def lease_copy(self, session_id: str, replica: str, lease: str, lease_s: float) -> bool:
        keys = [self._key(session_id, "s"), self._key(session_id, "c")]
        args = [replica, f"{replica}|{lease}", round(lease_s * 1000)]
        return bool(await self._run("lease_copy", keys, args))

    async def release_copy(self, session_id: str, replica: str, lease: str) -> None:
        keys = [self._key(session_id, "s"), self._key(session_id, "c")]
        await self._run("release_copy", keys, [replica, f"{replica}|{lease}"])

    async def delete(self, session_id: str) -> StoredSession | None:
        keys = [self._key(session_id, k) for k in ("s", "d", "t")] + [self._index]
        tombstone_ms = round(self.config.tombstone_ttl_s * 1000)
        flat = await self._run("delete", keys, [session_id, tombstone_ms])
        return self._session(session_id, flat) if flat else None

    async def sweep(self) -> list[StoredSession]:
        ended = []
        for raw in await self._run("expired", [self._index], [SWEEP_BATCH]):
            sid = raw.decode()
            flat = await self._run(
                "claim", [self._key(sid, "s"), self._key(sid, "d"), self._index], [sid]
            )
            if flat:  # claimed by us, and Redis had not dropped it yet
                ended.append(self._session(sid, flat))
        return ended

    async def admit_request(self, tenant: str, limit: int, window_s: float) -> float | None:
        wait_ms = await self._run(
            "admit_request",
            [self._tenant_key(tenant, "requests")],
            [secrets.token_hex(8), limit, round(window_s * 1000)],
        )
        return wait_ms / 1000 if wait_ms is not None else None

    async def start_job(self, tenant: str, job_id: str, limit: int, lease_s: float) -> int | None:
        running: int | None = await self._run(
            "start_job", [self._tenant_key(tenant, "jobs")], [job_id, limit, round(lease_s * 1000)]
        )
        return running

    async def renew_jobs(self, jobs: list[tuple[str, str]], lease_s: float) -> None:
        if jobs:
            await self._run(
                "renew_jobs",
                [self._tenant_key(tenant, "jobs") for tenant, _ in jobs],
                [round(lease_s * 1000), *(job_id for _, job_id in jobs)],
            )

    async def end_job(self, tenant: str, job_id: str) -> None:
        await self._run("remove", [self._tenant_key(tenant, "jobs")], [job_id])

    async def reserve(
        self, session: StoredSession, limit: int, lease_s: float
    ) -> dict[str, int] | None:
        flat = await self._run(
            "reserve",
            [self._index, self._reservations],
            [
                self.config.key_prefix,
                _reservation(session),
                session.tenant,
                limit,
                round(lease_s * 1000),
            ],
        )
        if flat is None:
            return None
        return {t.decode(): int(n) for t, n in zip(flat[::2], flat[1::2], strict=True)}

    async def unreserve(self, session: StoredSession) -> None:
        await self._run("remove", [self._reservations], [_reservation(session)])

    async def close(self) -> None:
        await self.client.aclose()

    def _session(self, session_id: str, flat: list[bytes]) -> StoredSession:
        fields = _fields(flat)
        options = self.cipher.open_field(_options_aad(session_id), fields["options"])
        return StoredSession(
            session_id=session_id,
            options=WiMOptions.model_validate_json(options),
            ttl_s=float(fields["ttl_ms"]) / 1000,
            tenant=fields["tenant"],
            replica=fields["replica"] or None,
            # Sessions stored before copies existed have neither field.
            copies=_copies(fields.get("copies", "")),
            context_tokens=int(fields["context_tokens"]),
            segments=int(fields["segments"]),
            kv_blocks=int(fields.get("kv_blocks", 0)),
            expires_at=float(fields["expires_ms"]) / 1000,
        )


def connect(url: str, config: StoreConfig) -> Redis:
    """A client that fails fast: one quick retry (a connection reset in passing), then
    `StoreUnavailable`, rather than redis-py's default of three retries backing off for
    seconds while the request waits on a dead Redis."""
    return Redis.from_url(
        url,
        socket_connect_timeout=config.connect_timeout_s,
        socket_timeout=config.timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
    )


def not_run(exc: BaseException | None) -> bool:
    """Whether Redis certainly did not run the call that failed with `exc`: its connection
    could not be made (refused, no route to the host, timed out: nothing was sent), or Redis
    answered LOADING (a restart reading its data back) or READONLY (a replica not yet
    promoted). A call cut off after it was sent may have run."""
    if isinstance(exc, redis_errors.BusyLoadingError | redis_errors.ReadOnlyError):
        return True
    if not isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError):
        return False
    # redis-py tells a failed connect from a failed read or write only in its message: "Error
    # 111 connecting to HOST:PORT. Connection refused.", "Error 22 connecting to ..." (a
    # blackhole route), "Timeout connecting to server" (a host that drops packets).
    return isinstance(exc.__cause__, ConnectionRefusedError) or "connecting to" in str(exc)


# Redis' answers for a state it leaves on its own or by an operator's hand, not a fault of the
# call: out of memory under `noeviction` (OOM), writes stopped after a failed save (MISCONF), a
# long script running (BUSY), a replica that lost its master (MASTERDOWN, NOREPLICAS), a slot
# moving (TRYAGAIN). New work gets 503 with Retry-After for them, like a Redis that is down.
PASSING_STATES = frozenset({"OOM", "MISCONF", "BUSY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN"})


def passing_state(exc: redis_errors.ResponseError) -> str | None:
    """The code of `exc` if it is Redis' answer for a passing state (`PASSING_STATES`), else
    None. redis-py strips the code from the message of the errors it has a class for, and keeps
    it in the message of the others (and, from 6, in `status_code`)."""
    if isinstance(exc, redis_errors.OutOfMemoryError):
        return "OOM"
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code if code in PASSING_STATES else None


def _reservation(session: StoredSession) -> str:
    """A reservation names its tenant after the id (ids have no `|`: `doc-<hex>`)."""
    return f"{session.session_id}|{session.tenant}"


def _fields(flat: list[bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2], strict=True)}


def _copies(joined: str) -> tuple[str, ...]:
    return tuple(r for r in joined.split(",") if r)


def _options_aad(session_id: str) -> str:
    """What a session's options are sealed with: not its text's (the session id), so that
    neither decrypts in the other's place."""
    return f"{session_id}|options"
