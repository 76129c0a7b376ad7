"""The document sessions one engine replica holds, and the rule that closes orphans.

Routers claim the sessions bound to a replica every load poll (`WiMRouter._claim_documents`);
one that no router claimed for `orphan_timeout_s` belongs to a router that is gone (restarted
without a shared store, or with its store lost), and its KV would stay pinned for nobody. A
session with a query running or waiting is never an orphan: that query came through a router
that holds the session now, even if that router cannot list its sessions (its store is down).

Free of Ray, so that the rule is tested without a replica (`tests/test_held_documents.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from wim_service.wim.orchestrator import WiMSession

logger = logging.getLogger(__name__)

DEFAULT_ORPHAN_TIMEOUT_S = 60.0


@dataclass
class _Held:
    session: WiMSession
    claimed: float  # monotonic time a router last said it holds this session, or used it


class HeldDocuments:
    """Document id -> its session on this replica, with when it was last claimed."""

    def __init__(self, orphan_timeout_s: float = DEFAULT_ORPHAN_TIMEOUT_S) -> None:
        self.orphan_timeout_s = orphan_timeout_s
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def sessions(self) -> Iterator[WiMSession]:
        return (held.session for held in self._held.values())

    async def add(self, document_id: str, session: WiMSession, now: float) -> None:
        """Hold `session` as `document_id`'s. A session already held under that id is closed:
        two opens of one document that ran at once (two routers reading a copy of a hot
        document at the same moment) would otherwise leave the first one's KV pinned, out of
        this table, where neither DELETE nor the orphan rule ever reaches it."""
        replaced = self._held.get(document_id)
        self._held[document_id] = _Held(session, now)
        if replaced is not None and replaced.session is not session:
            await replaced.session.close()

    def use(self, document_id: str, now: float) -> WiMSession | None:
        """The session, counted as claimed now (a query came for it through a router)."""
        held = self._held.get(document_id)
        if held is None:
            return None
        held.claimed = now
        return held.session

    def claim(self, document_ids: list[str], now: float) -> int:
        """A router holds these sessions; returns how many of them are here."""
        here = 0
        for document_id in document_ids:
            held = self._held.get(document_id)
            if held is not None:
                held.claimed = now
                here += 1
        return here

    def _orphan(self, held: _Held, now: float) -> bool:
        return held.claimed < now - self.orphan_timeout_s and not held.session.busy

    def orphans(self, now: float) -> list[str]:
        """Sessions nobody claimed for `orphan_timeout_s`, and that no query uses."""
        return [d for d, held in self._held.items() if self._orphan(held, now)]

    async def close(self, document_id: str) -> bool:
        """Close a session, stopping a query that runs on it; False if it is not here."""
        held = self._held.pop(document_id, None)
        if held is None:
            return False
        await held.session.close()
        return True

    async def reap(self, now: float) -> int:
        """Close the orphans; returns how many."""
        closed = 0
        for document_id in self.orphans(now):
            held = self._held.get(document_id)
            # Closing the ones before yielded: this one may have been claimed or queried since.
            if held is not None and self._orphan(held, now):
                closed += await self.close(document_id)
        if closed:
            logger.info("closed %d document sessions no router claims", closed)
        return closed
