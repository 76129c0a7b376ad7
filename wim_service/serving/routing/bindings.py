"""How a placement went, as `wim_session_binding_total` counts it. Where work goes and what it
books there is the ledger's (`placement/ledger.py`, `ReplicaFleet.ledger`); a document session's
binding lives in the session store, shared by every router.
"""

from __future__ import annotations

from enum import StrEnum


class BindResult(StrEnum):
    HIT = "hit"  # the session's replica is alive: use it
    NEW = "new"  # a new session was placed
    REPIN = "repin"  # the session's replica is gone: moved elsewhere
    REJECTED = "rejected"  # nowhere to place it now
