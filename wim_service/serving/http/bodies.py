"""The HTTP API's request and response bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wim_service.wim.events import Timings, Usage
from wim_service.wim.options import Utf8Text, WiMOptions

# Longest query the API takes (characters); a document's limit is the router's
# `max_document_chars` (413), checked before tokenization.
MAX_QUERY_CHARS = 20_000


class WiMRequest(BaseModel):
    """`POST /wim`: a one-shot job (`context`) or a query on a document session (`document_id`)."""

    model_config = ConfigDict(extra="forbid")

    context: Utf8Text | None = Field(None, description="The document, for a one-shot job.")
    document_id: str | None = Field(
        None, max_length=128, description="A document session from POST /documents."
    )
    query: Utf8Text = Field(..., min_length=1, max_length=MAX_QUERY_CHARS)
    options: WiMOptions = Field(default_factory=WiMOptions)
    stream: bool = Field(False, description="Answer as text/event-stream.")

    @model_validator(mode="after")
    def _one_source(self) -> WiMRequest:
        if (self.context is None) == (self.document_id is None):
            raise ValueError("give exactly one of `context` and `document_id`")
        return self


class MarginOut(BaseModel):
    """A margin as `POST /wim` returns it (the `margin` event of a stream carries the same)."""

    segment: int
    text: str
    relevant: bool
    grounded: bool = Field(False, description="Its own segment supports what it says.")
    cut_short: bool = Field(
        False,
        description="Writing stopped once it named a number or name that its segment lacks, "
        "or that only sentences far from the query hold (no continuation could be kept); "
        "`text` ends there.",
    )
    skipped: bool = Field(
        False,
        description="Not written: no sentence window of its segment shares enough of the "
        "query's words for a note to be kept (`skip_unmatched_segments`).",
    )
    kept: bool = Field(False, description="It went on to the final prompt.")
    evidence: str = Field("", description="The segment's sentence(s) that support it.")
    evidence_start: int | None = None
    evidence_end: int | None = None


class WiMResponse(BaseModel):
    answer: str
    margins: list[MarginOut]
    notes: list[int] = Field(
        default_factory=list, description="Segments whose margins the final prompt held."
    )
    notes_dropped: list[int] = Field(
        default_factory=list, description="Kept margins the context window had no room for."
    )
    usage: Usage
    timings: Timings
    session_id: str
    replica: str


class DocumentRequest(BaseModel):
    """`POST /documents`: read a document once, ask many queries."""

    model_config = ConfigDict(extra="forbid")

    context: Utf8Text = Field(..., min_length=1)
    ttl_s: float | None = Field(None, gt=0, description="Idle lifetime (default: server's).")
    options: WiMOptions = Field(default_factory=WiMOptions)


class DocumentResponse(BaseModel):
    document_id: str
    context_tokens: int
    segments: int
    expires_at: float  # unix seconds
    replica: str


class ErrorBody(BaseModel):
    code: str
    message: str
