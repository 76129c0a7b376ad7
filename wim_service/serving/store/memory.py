"""`MemorySessionStore`: the sessions in this process, for a single router (the default).

Every method runs without awaiting anything, so on the router's event loop each one is atomic.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, replace

from wim_service.serving.store.base import Holding, SessionExists, StoredSession


@dataclass
class _Entry:
    session: StoredSession
    text: str


class MemorySessionStore:
    def __init__(self, tombstone_ttl_s: float = 600.0) -> None:
        self.tombstone_ttl_s = tombstone_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._tombstones: dict[str, float] = {}  # session id -> until (unix seconds)
        # Per tenant: request times in the window; job id -> lease end. Reservations: session
        # id -> (tenant, lease end). All in monotonic seconds.
        self._requests: defaultdict[str, deque[float]] = defaultdict(deque)
        self._jobs: defaultdict[str, dict[str, float]] = defaultdict(dict)
        self._reserved: dict[str, tuple[str, float]] = {}
        # Per copy (session id, replica): its queries' leases (lease -> end) and when one was
        # last taken or given back, in monotonic seconds.
        self._leases: defaultdict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        self._used: dict[tuple[str, str], float] = {}

    def _live(self, session_id: str) -> _Entry | None:
        entry = self._entries.get(session_id)
        if entry is None or entry.session.expires_at <= time.time():
            return None
        return entry

    async def create(self, session: StoredSession, text: str) -> StoredSession:
        now = time.time()
        sid = session.session_id
        if sid in self._entries or self._tombstones.get(sid, 0.0) > now:
            raise SessionExists(sid)
        stored = replace(session, expires_at=now + session.ttl_s)
        self._entries[sid] = _Entry(stored, text)
        self._reserved.pop(sid, None)
        return stored

    async def get(self, session_id: str) -> StoredSession | None:
        entry = self._live(session_id)
        return entry.session if entry else None

    async def text(self, session_id: str) -> str | None:
        entry = self._live(session_id)
        return entry.text if entry else None

    async def touch(self, session_id: str, hold_s: float = 0.0) -> float | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        expires_at = time.time() + max(entry.session.ttl_s, hold_s)
        entry.session = replace(entry.session, expires_at=expires_at)
        return expires_at

    async def holdings(self) -> list[Holding]:
        return [Holding(s.session_id, s.replica, s.copies, s.tenant) for s in self._live_sessions()]

    def _live_sessions(self) -> list[StoredSession]:
        now = time.time()
        return [e.session for e in self._entries.values() if e.session.expires_at > now]

    async def rebind(
        self, session_id: str, expected: str | None, new: str | None, *, promote: bool = False
    ) -> bool:
        entry = self._live(session_id)
        if entry is None or entry.session.replica != expected:
            return False
        if promote and new not in entry.session.copies:
            return False
        copies = tuple(r for r in entry.session.copies if r != new)
        entry.session = replace(entry.session, replica=new, copies=copies)
        self._leases.pop((session_id, new or ""), None)  # a primary is never retired
        self._used.pop((session_id, new or ""), None)
        return True

    async def add_copy(
        self, session_id: str, replica: str, max_holders: int, tenant_slots: int | None = None
    ) -> bool:
        entry = self._live(session_id)
        if (
            entry is None
            or replica in entry.session.holders
            or 1 + len(entry.session.copies) >= max_holders
        ):
            return False
        if tenant_slots is not None:
            tenant = entry.session.tenant
            held = sum(1 + len(s.copies) for s in self._live_sessions() if s.tenant == tenant)
            if held >= tenant_slots:
                return False
        entry.session = replace(entry.session, copies=(*entry.session.copies, replica))
        return True

    async def drop_copy(self, session_id: str, replica: str, idle_s: float | None = None) -> bool:
        entry = self._live(session_id)
        if entry is None or replica not in entry.session.copies:
            return False
        key, now = (session_id, replica), time.monotonic()
        if idle_s is not None:
            leases = {lease: end for lease, end in self._leases[key].items() if end > now}
            self._leases[key] = leases
            if leases or now - self._used.get(key, -math.inf) < idle_s:
                return False
        copies = tuple(r for r in entry.session.copies if r != replica)
        entry.session = replace(entry.session, copies=copies)
        self._leases.pop(key, None)
        self._used.pop(key, None)
        return True

    async def lease_copy(self, session_id: str, replica: str, lease: str, lease_s: float) -> bool:
        entry = self._live(session_id)
        if entry is None or replica not in entry.session.copies:
            return False
        now = time.monotonic()
        self._leases[(session_id, replica)][lease] = now + lease_s
        self._used[(session_id, replica)] = now
        return True

    async def release_copy(self, session_id: str, replica: str, lease: str) -> None:
        key = (session_id, replica)
        if self._leases.get(key, {}).pop(lease, None) is not None:
            self._used[key] = time.monotonic()

    async def delete(self, session_id: str) -> StoredSession | None:
        entry = self._entries.pop(session_id, None)
        self._tombstones[session_id] = time.time() + self.tombstone_ttl_s
        if entry is not None:
            self._forget_copies(entry.session)
        return entry.session if entry else None

    def _forget_copies(self, session: StoredSession) -> None:
        """An ended session's copies hold no leases (their queries end with it)."""
        for replica in session.copies:
            self._leases.pop((session.session_id, replica), None)
            self._used.pop((session.session_id, replica), None)

    async def sweep(self) -> list[StoredSession]:
        now = time.time()
        self._tombstones = {s: until for s, until in self._tombstones.items() if until > now}
        ended = [e.session for e in self._entries.values() if e.session.expires_at <= now]
        for session in ended:
            del self._entries[session.session_id]
            self._forget_copies(session)
        return ended

    async def admit_request(self, tenant: str, limit: int, window_s: float) -> float | None:
        now = time.monotonic()
        recent = self._requests[tenant]
        while recent and recent[0] <= now - window_s:
            recent.popleft()
        if len(recent) >= limit:
            return recent[0] + window_s - now
        recent.append(now)
        return None

    async def start_job(self, tenant: str, job_id: str, limit: int, lease_s: float) -> int | None:
        now = time.monotonic()
        jobs = self._jobs[tenant]
        for expired in [j for j, until in jobs.items() if until <= now]:
            del jobs[expired]
        if len(jobs) >= limit:
            return len(jobs)
        jobs[job_id] = now + lease_s
        return None

    async def renew_jobs(self, jobs: list[tuple[str, str]], lease_s: float) -> None:
        now = time.monotonic()
        for tenant, job_id in jobs:
            leases = self._jobs[tenant]
            if leases.get(job_id, 0.0) > now:
                leases[job_id] = now + lease_s

    async def end_job(self, tenant: str, job_id: str) -> None:
        self._jobs[tenant].pop(job_id, None)

    async def reserve(
        self, session: StoredSession, limit: int, lease_s: float
    ) -> dict[str, int] | None:
        now = time.monotonic()
        self._reserved = {s: r for s, r in self._reserved.items() if r[1] > now}
        live = self._live_sessions()
        documents = Counter(s.tenant for s in live)
        documents.update(tenant for tenant, _ in self._reserved.values())
        if documents[session.tenant] >= limit:
            return None
        self._reserved[session.session_id] = (session.tenant, now + lease_s)
        documents[session.tenant] += 1
        slots = Counter(documents)
        for s in live:  # a copy holds a session slot of its own
            slots[s.tenant] += len(s.copies)
        return dict(slots)

    async def unreserve(self, session: StoredSession) -> None:
        self._reserved.pop(session.session_id, None)

    async def close(self) -> None:
        """Nothing to release: the sessions live as long as this process."""
