"""The engine request timeline: when each request of a WiM context ran, as this layer saw it.

Tests and the benchmark read it to tell what overlapped (a margin's prefill beside the next
push) and what was cut short; it costs one deque append per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Request spans kept in `VLLMBackend.timeline` (the most recent ones).
TIMELINE_SPANS = 4096


@dataclass
class RequestSpan:
    """One engine request of a context as this layer saw it: what overlapped, what was cut.

    `kind` is "push" (a context input) or the `RequestKind` of a branch, stand-alone turn or
    conclusion. `context_tokens` is, for a push, the context's length after it; for a branch,
    the context prefix it reads; for a conclusion, the whole context; 0 for a stand-alone turn.
    Times are `time.monotonic()`. A span that `ended` without `finished` was abandoned (aborted,
    or its caller stopped waiting).
    """

    context: str  # the context's cache salt
    kind: str
    context_tokens: int
    started: float
    first_output: float | None = None
    ended: float | None = None
    finished: bool = False
    output_tokens: int = 0

    def output(self, token_ids: list[int], finished: bool) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()
        self.output_tokens += len(token_ids)
        self.finished = finished
