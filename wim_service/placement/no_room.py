"""What a placement that finds no room does next: the one order the live router
(`ReplicaFleet.place`, async) and `wim sim` (`Replay._booked`, at its own clock) both follow
before they refuse work (`429` with Retry-After). Each drives a `NoRoomSteps`: it says the next
step, the caller takes it and places the work again.

1. The loads are asked again (at most once per `FRESH_LOADS_S`, `placement/polls.py`): between
   two reports the ledger counts work that may have ended (a one-shot job's KV, an ended
   session's), and work is refused on fresh loads only.
2. Idle spare copies of hot documents are closed (`reclaim`; which ones: `CopyBook.spare` in
   `placement/copies.py`) and, if any closed, every replica's load polled: a spare copy's KV
   and session slot serve new work better than its document's next query would.
3. The work is refused.

With no replica that may take work at all (starting, or every one lost) nothing is asked or
reclaimed: the router waits a while for one (`replica_wait_s`), `wim sim` refuses at once.
"""

from __future__ import annotations

from enum import Enum


class Step(Enum):
    REFRESH = "refresh"  # ask for the loads again (unless asked just now), then place again
    RECLAIM = "reclaim"  # close spare copies, then ask `NoRoomSteps.reclaimed` what next
    POLL = "poll"  # poll every replica's load (room was freed), then place again
    WAIT = "wait"  # no replica may take work: wait for one, poll, then place again
    REFUSE = "refuse"


class NoRoomSteps:
    """One placement's steps after it found no room, in the order above; `reclaims`: whether
    the caller has a reclaim of copies to try."""

    def __init__(self, *, reclaims: bool) -> None:
        self._refresh = True  # the loads are still to be asked again
        self._reclaim = reclaims  # a reclaim is still to be tried

    def after(self, live: int, *, may_wait: bool = False) -> Step:
        """The step after the work found no room among `live` replicas that may take work
        (`NoRoom.replicas`); `may_wait`: whether to wait for one while there is none."""
        if not live:
            return Step.WAIT if may_wait else Step.REFUSE
        if self._refresh:
            self._refresh = False
            return Step.REFRESH
        if self._reclaim:
            self._reclaim = False
            return Step.RECLAIM
        return Step.REFUSE

    @staticmethod
    def reclaimed(closed: int) -> Step:
        """The step after a reclaim closed `closed` copies: with none closed, no room opened."""
        return Step.POLL if closed else Step.REFUSE
