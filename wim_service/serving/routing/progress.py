"""What a streamed job already delivered to its client, so that a failover does not repeat it
(`dispatcher.Dispatcher` keeps one per job across its attempts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from wim_service.wim.events import WiMEvent


@dataclass
class StreamProgress:
    """What a streamed job already delivered, so that a failover does not repeat it."""

    segments: set[int] = field(default_factory=set)
    margins: set[int] = field(default_factory=set)
    answer_sent: int = 0  # answer characters the client has
    answer_seen: int = 0  # answer characters of the current attempt

    def new_attempt(self) -> None:
        self.answer_seen = 0

    def fresh(self, event: WiMEvent) -> bool:
        """False for what an earlier attempt already delivered (answer text is trimmed)."""
        if event.type in ("segment", "margin"):
            seen = self.segments if event.type == "segment" else self.margins
            if event.segment in seen:
                return False
            seen.add(event.segment)
        elif event.type == "answer":
            # Greedy decoding repeats the same answer; `done.answer` is authoritative anyway.
            start = self.answer_seen
            self.answer_seen += len(event.text)
            event.text = event.text[max(0, self.answer_sent - start) :]
            self.answer_sent = max(self.answer_sent, self.answer_seen)
            return bool(event.text)
        return True
