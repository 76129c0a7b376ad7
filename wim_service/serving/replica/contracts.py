"""What the router and the engine replicas exchange: typed models, never dicts checked by key.

Ray pickles these objects between processes as they are; both sides import this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from wim_service.placement.ledger import LoadReport
from wim_service.wim.events import ErrorEvent


class ReplicaLoad(BaseModel):
    """What a replica reports about itself, never changed once sent: the router books the
    work it places between two reports apart from it (`placement/ledger.py`)."""

    model_config = ConfigDict(frozen=True)

    replica: str
    capacity_blocks: int
    reserved_blocks: int
    sessions: int
    # Sessions the replica's admission control takes at once (its `max_sessions`).
    max_sessions: int = 1 << 30
    documents: int = 0
    resident_kv_tokens: int = 0
    healthy: bool = True
    draining: bool = False
    # Expected seconds of admitted work still ahead on this replica, and the jobs running:
    # what the `expected_wait` placement weighs (`placement/backlog.py`).
    backlog_s: float = 0.0
    running: int = 0
    # The dtype its engine runs in ("" if not reported): the router's cost profile should be
    # of the same (`EngineProfile.dtype_mismatch`).
    dtype: str = ""

    def report(self) -> LoadReport:
        """What placement reads of it, for the router's ledger."""
        return LoadReport(
            self.replica,
            capacity_blocks=self.capacity_blocks,
            reserved_blocks=self.reserved_blocks,
            sessions=self.sessions,
            max_sessions=self.max_sessions,
            healthy=self.healthy,
            draining=self.draining,
            backlog_s=self.backlog_s,
            running=self.running,
        )


class DocumentOpened(BaseModel):
    """A document read into a pinned context on a replica."""

    type: Literal["opened"] = "opened"
    context_tokens: int
    segments: int
    # Of `context_tokens`, those loaded from the KV store instead of computed (a rebuild or
    # a copy of a document whose KV was saved: engine/kv_transfer).
    restored_tokens: int = 0


# `open_document`'s answer: the opened document, or why it could not be read.
OpenResult = Annotated[DocumentOpened | ErrorEvent, Field(discriminator="type")]


class EngineDead(RuntimeError):
    """Raised by a replica whose engine has died: the router fails the call over elsewhere
    (Ray re-raises it in the router as an instance of this class)."""
