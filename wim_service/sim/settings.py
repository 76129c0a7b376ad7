"""The simulator's settings besides the engine profile."""

from __future__ import annotations

from dataclasses import dataclass

from wim_service.placement.policy import DEFAULT_MAX_COPIES


@dataclass(frozen=True)
class SimSettings:
    # Session slots per replica: copies held plus jobs running without one (the service's
    # max_sessions admission, 4 in its default deployment).
    slots: int = 4
    # A copy no job has used for this long is retired: its KV and slot come back.
    copy_idle_s: float = 120.0
    segment_tokens: int = 1024  # a WiM query writes one margin per segment of its document
    margin_tokens: int = 24  # tokens decoded per margin
    max_copies: int = DEFAULT_MAX_COPIES  # copies of one document the `wim` policy may open
    # Whether a replica's backlog (what placement reads) counts its batch's decode left, or
    # only the prefills booked ahead (engine.py says why both are defensible).
    backlog_decode: bool = True

    def check(self) -> None:
        if self.slots < 1:
            raise ValueError("session slots must be at least 1")
        if self.copy_idle_s < 0:
            raise ValueError("copy idle seconds must be at least 0")
        if self.segment_tokens < 1 or self.margin_tokens < 1:
            raise ValueError("segment and margin tokens must be at least 1")
        if self.max_copies < 1:
            raise ValueError("max copies must be at least 1")
