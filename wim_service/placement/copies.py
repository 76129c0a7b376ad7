"""The copies of documents beside their primary, as one router or `wim sim` keeps them: the
queries running on each and when each was last used, and so which are idle (closed after
`copy_idle_s`) or spare (closed at once to make room, `reclaim`): which ones a sweep closes is
chosen here (`CopyBook.spare`), the router and `wim sim` only close them.

A copy is never idle while a query runs on it. The primary (the replica a session was first
read on) is not a copy here: closing it ends the session, which its TTL or a DELETE decides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from wim_service.placement.ledger import Booking, Ledger
from wim_service.placement.state import NoRoom, Work

# A copy no query used for this long is closed, its KV and session slot given back: the
# router's `copy_idle_s` and `wim sim`'s default.
DEFAULT_COPY_IDLE_S = 120.0

Key = tuple[str, str]  # (document, replica)


class QuerySteps:
    """A document query's placement among its session's holders, in the one order the live
    router (`DocumentCopies.holder`, async) and `wim sim` (`Replay._holder`, at its own clock)
    both follow. Each drives a `QuerySteps`: `place` until it needs no fresh loads (the caller
    asks for them between), then `settle`.

    1. The query is placed by the policy among the holders, booked; if no replica has room,
       it waits its turn on its session's primary, unbooked (its holders' admission queues it).
    2. A placement that opens a copy on loads a poll old, by a policy that weighs loads, is
       cancelled, the loads asked again (`placement/polls.py`) and the query placed again on
       them, among the holders still live (none left: on the primary): a copy costs a whole
       read. Round robin would only take another turn.
    3. The copy opens only beside holders whose loads are known (the policy weighed them),
       within `max_copies` holders (a policy other than `expected_wait` may ask for more), and
       one read of a document at a time; else the booking is cancelled and the query runs on
       its primary, unbooked.
    """

    def __init__(self, ledger: Ledger, work: Work) -> None:
        assert work.document is not None
        self.ledger, self.work = ledger, work
        self.booking: Booking | None = None  # the last placement's, None: on the primary
        self._asked = False  # the loads were asked again for this query

    def place(self, holders: Collection[str]) -> bool:
        """Place the query among `holders` (`booking`); True: the placement was cancelled,
        ask the loads again and `place` again, among the holders still live."""
        self.booking = None
        if self._asked and not holders:
            return False
        try:
            booking = self.ledger.place(self.work, holders=holders)
        except NoRoom:
            return False
        if self._asked or not (booking.placement.open_copy and self.ledger.policy.weighs_loads):
            self.booking = booking
            return False
        self.ledger.cancel(booking)
        self._asked = True
        return True

    def settle(self, holders: Collection[str], max_copies: int, opening: bool) -> Booking | None:
        """Where the query runs, booked (on a holder, or a copy to open there first); None: on
        its session's primary, unbooked. `opening`: a copy of the document is being read."""
        booking = self.booking
        if booking is None or not booking.placement.open_copy:
            return booking
        known = all(self.ledger.load(r) is not None for r in holders)
        if known and len(holders) < max_copies and not opening:
            return booking
        self.ledger.cancel(booking)  # nothing runs there after all
        return None


class CopyBook:
    def __init__(self) -> None:
        self._running: Counter[Key] = Counter()  # queries running, on copies and primaries
        self._used: dict[Key, float] = {}  # every copy -> when a query last ended on it

    def __len__(self) -> int:
        return len(self._used)

    def __contains__(self, key: object) -> bool:
        return key in self._used

    def opened(self, document: str, replica: str, now: float) -> None:
        """A copy of `document` was read on `replica`: idle from `now` until a query runs."""
        self._used[(document, replica)] = now

    def listed(self, copies: Iterable[Key], now: float) -> None:
        """The copies that exist (a session store's listing): one not known here (another
        router opened it) is idle from `now`; one no longer listed is forgotten."""
        self._used = {key: self._used.get(key, now) for key in copies}

    def closed(self, document: str, replica: str) -> None:
        self._used.pop((document, replica), None)

    def begin(self, document: str, replica: str) -> None:
        """A query starts on `replica`'s copy (or primary) of `document`."""
        self._running[(document, replica)] += 1

    def end(self, document: str, replica: str, now: float) -> None:
        key = (document, replica)
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]
        if key in self._used:
            self._used[key] = now

    def holders(self, document: str) -> list[str]:
        """The replicas holding a copy of `document`, in the order they were opened."""
        return [replica for held, replica in self._used if held == document]

    def running(self, document: str, replica: str) -> int:
        return self._running[(document, replica)]

    def idle(self, now: float, idle_s: float) -> list[Key]:
        """The copies no query runs on and none has used for `idle_s` (0: spare now), in the
        order they were opened."""
        return [
            key
            for key, used in self._used.items()
            if not self._running[key] and now - used >= idle_s
        ]

    def spare(
        self,
        now: float,
        idle_s: float = 0.0,
        *,
        holders: Mapping[str, int] | None = None,
        tenants: Mapping[str, str] | None = None,
        only: str | None = None,
    ) -> list[Key]:
        """The copies a sweep closes (retiring the idle, or a reclaim), in the order they were
        opened: those `idle` for `idle_s` (0: every spare one); only tenant `only`'s if given
        (`tenants`: each document's); never a document's last holder where `holders` counts
        each document's holders, primaries too (`wim sim` closes a primary idle for
        `copy_idle_s`, and one of its copies stays; the router's primary is never in the book
        and closes with its session). The caller closes them, but one it finds in use by then."""
        left = Counter(holders or {})
        spare: list[Key] = []
        for document, replica in self.idle(now, idle_s):
            if only is not None and (tenants or {}).get(document) != only:
                continue
            if holders is not None:
                if left[document] <= 1:
                    continue
                left[document] -= 1
            spare.append((document, replica))
        return spare
