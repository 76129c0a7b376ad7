"""The typed event stream of a job: what the CLI prints and the service streams as SSE."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from wim_service.wim.errors import WiMError


class Usage(BaseModel):
    """Token accounting of one job (prompt tokens are summed over every engine request)."""

    context_tokens: int = 0  # prompt tokens before the query: template prefix + document
    segments: int = 0
    prompt_tokens_submitted: int = 0
    prompt_tokens_computed: int = 0  # submitted minus those served from the KV/prefix cache
    prompt_tokens_cached: int = 0
    # Tokens that must be computed at least once: prefix + document, each margin (and
    # classifier) instruction, the final prompt.
    minimal_prompt_tokens: int = 0
    margin_tokens: int = 0  # generated margin (and classifier) tokens
    answer_tokens: int = 0
    # Tokens of an answer started early that a later kept margin made moot (`answer_early`).
    discarded_answer_tokens: int = 0

    @property
    def excess_computed_tokens(self) -> int:
        return self.prompt_tokens_computed - self.minimal_prompt_tokens


class Timings(BaseModel):
    """Seconds from the job's start (queue wait excluded from the other marks)."""

    queue_s: float = 0.0  # waiting for KV admission
    prefill_s: float = 0.0  # until the last segment's KV was computed
    margins_s: float = 0.0  # until the last margin was decided
    answer_ttft_s: float = 0.0  # until the first answer token
    total_s: float = 0.0


class SegmentEvent(BaseModel):
    type: Literal["segment"] = "segment"
    segment: int  # 0-based
    segments: int
    tokens: int
    context_tokens: int  # document tokens prefilled so far
    char_start: int
    char_end: int


class MarginEvent(BaseModel):
    type: Literal["margin"] = "margin"
    segment: int
    text: str  # as the model wrote it (a first-token margin without its YES)
    # The relevance mode's verdict (and the margin is not empty); a cut-short margin is not
    # judged by the classifier (false).
    relevant: bool
    # The segment's own sentences support the margin (reported whatever the grounding mode).
    grounded: bool = False
    # Writing stopped early: the margin had named a number or name (or denied something) that
    # no window of its segment holds, or (with snapping) only windows that share too little with
    # the query, so no continuation could be kept. `text` ends there.
    cut_short: bool = False
    # Not written (`skip_unmatched_segments`): no window of the segment shares enough with the
    # query for a note to be kept, so no engine request was made; `text` is empty.
    skipped: bool = False
    # The margin goes on to the final prompt (relevant, grounded unless grounding is off, and
    # enough overlap with the query); the window may still leave it out (DoneEvent).
    kept: bool = False
    # The supporting sentence(s) and their character span in the document, when grounded.
    evidence: str = ""
    evidence_start: int | None = None
    evidence_end: int | None = None
    char_start: int
    char_end: int
    elapsed_s: float  # from the margin's submission to its decision


class AnswerEvent(BaseModel):
    type: Literal["answer"] = "answer"
    text: str  # a delta: concatenate to get the answer


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    answer: str
    # Segments whose notes the final prompt holds, and kept notes the window had no room for.
    notes: list[int] = Field(default_factory=list)
    notes_dropped: list[int] = Field(default_factory=list)
    usage: Usage
    timings: Timings


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str
    retry_after_s: float | None = None  # set with code "overloaded"

    @classmethod
    def of(cls, exc: WiMError) -> ErrorEvent:
        """The event that reports `exc`, its retry hint included."""
        return cls(code=exc.code.value, message=exc.message, retry_after_s=exc.retry_after_s)


WiMEvent = Annotated[
    SegmentEvent | MarginEvent | AnswerEvent | DoneEvent | ErrorEvent,
    Field(discriminator="type"),
]
