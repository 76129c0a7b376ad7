"""One query's state, from its first margin to its `DoneEvent`.

A query carries its options (and the note policy they make), where its events go, its token
ledger and timings, the KV room its early answers may take, and the drafts of its running
margins. The margin writer, the early answers and the final answer all read and write this one
object instead of passing each piece along.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from wim_service.wim.backend import PromptCost
from wim_service.wim.capacity import JobShape
from wim_service.wim.events import Timings, Usage, WiMEvent
from wim_service.wim.notes import NotePolicy
from wim_service.wim.options import WiMOptions
from wim_service.wim.plan import DocumentPlan

Emit = Callable[[WiMEvent], None]


@dataclass
class Ledger:
    """Prompt-token accounting of one job."""

    submitted: int = 0
    cached: int = 0
    minimal: int = 0
    margin_tokens: int = 0
    answer_tokens: int = 0
    discarded_answer_tokens: int = 0

    def add(self, cost: PromptCost | None, *, minimal: int) -> None:
        if cost is not None:
            self.submitted += cost.submitted
            self.cached += cost.cached
        self.minimal += minimal

    def usage(self, plan: DocumentPlan) -> Usage:
        return Usage(
            context_tokens=plan.context_tokens,
            segments=len(plan.segments),
            prompt_tokens_submitted=self.submitted,
            prompt_tokens_computed=self.submitted - self.cached,
            prompt_tokens_cached=self.cached,
            minimal_prompt_tokens=self.minimal,
            margin_tokens=self.margin_tokens,
            answer_tokens=self.answer_tokens,
            discarded_answer_tokens=self.discarded_answer_tokens,
        )


@dataclass(frozen=True)
class QueryRoom:
    """The KV blocks a query may hold beyond the pinned context, and the shape of its job."""

    shape: JobShape
    blocks: int

    def holds_early_answers(
        self, block: int, pending_margins: int, suffix_tokens: Sequence[int]
    ) -> bool:
        return self.shape.early_answer_blocks(block, pending_margins, suffix_tokens) <= self.blocks


@dataclass
class QueryRun:
    """One query being answered over a pinned document."""

    query: str
    options: WiMOptions
    emit: Emit
    room: QueryRoom
    started: float  # `time.perf_counter()` at its start: the origin of its timings
    policy: NotePolicy = field(init=False)
    ledger: Ledger = field(default_factory=Ledger)
    timings: Timings = field(default_factory=Timings)
    # What each running margin has written so far (as `ground` will read it), by segment:
    # early answers are started over the notes these drafts still point to.
    drafts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = NotePolicy.of(self.options)
