"""Admission control: a document session may start only if its worst-case KV fits.

A parked WiM context holds its KV blocks and a sequence slot and can never be preempted, so an
engine that admits more documents than its KV holds deadlocks (vLLM cannot evict what parked
sessions pin). Each session therefore reserves its worst-case blocks up front; a session that
does not fit waits, in arrival order, for up to `timeout_s`, then is refused as overloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from wim_service.wim.errors import ErrorCode, WiMError


@dataclass(frozen=True)
class AdmissionLoad:
    sessions: int
    reserved_blocks: int
    capacity_blocks: int
    waiting: int


class KVAdmission:
    def __init__(
        self, capacity_blocks: int, max_sessions: int, timeout_s: float, keep_free_blocks: int = 0
    ) -> None:
        self.capacity_blocks = capacity_blocks
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        # Blocks `acquire_now` leaves free: a session's side-by-side query takes none of
        # them (`EngineConfig.side_by_side_kv_reserve`).
        self.keep_free_blocks = keep_free_blocks
        self.sessions = 0
        self.reserved_blocks = 0
        self._waiters: deque[asyncio.Event] = deque()

    def load(self) -> AdmissionLoad:
        return AdmissionLoad(
            self.sessions, self.reserved_blocks, self.capacity_blocks, len(self._waiters)
        )

    def _fits(self, blocks: int, session: bool) -> bool:
        return (
            not session or self.sessions < self.max_sessions
        ) and self.reserved_blocks + blocks <= self.capacity_blocks

    async def acquire(self, blocks: int, *, session: bool = True) -> None:
        """Reserve `blocks` for a new session, or (`session=False`) more for a running one."""
        if blocks > self.capacity_blocks:
            raise WiMError(
                ErrorCode.TOO_LONG,
                f"the job needs up to {blocks} KV blocks but this engine holds "
                f"{self.capacity_blocks}; send a shorter document",
            )
        if self._waiters or not self._fits(blocks, session):
            await self._wait_turn(blocks, session)
        self.sessions += session
        self.reserved_blocks += blocks

    def acquire_now(self, blocks: int) -> bool:
        """Reserve `blocks` more for a running session if they are free now, with
        `keep_free_blocks` still free after them, and nobody waits for room (never ahead of a
        waiting session); False if not."""
        if self._waiters or not self._fits(blocks + self.keep_free_blocks, session=False):
            return False
        self.reserved_blocks += blocks
        return True

    async def _wait_turn(self, blocks: int, session: bool) -> None:
        """Queue in arrival order until this request is first in line and fits."""
        deadline = time.monotonic() + self.timeout_s
        turn = asyncio.Event()
        self._waiters.append(turn)
        try:
            while not (self._waiters[0] is turn and self._fits(blocks, session)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WiMError(
                        ErrorCode.OVERLOADED,
                        f"no KV capacity for this document now ({self.sessions} sessions hold "
                        f"{self.reserved_blocks}/{self.capacity_blocks} blocks); retry later",
                        retry_after_s=max(1.0, self.timeout_s / 2),
                    )
                turn.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await turn.wait()
        finally:
            self._waiters.remove(turn)
            # The next in line may fit now (or may have been blocked only by this one).
            self._wake()

    def release(self, blocks: int, *, session: bool = True) -> None:
        self.sessions -= session
        self.reserved_blocks -= blocks
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            self._waiters[0].set()
