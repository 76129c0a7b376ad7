"""Per-job options, validated at the edge (CLI flags, HTTP bodies, Python callers alike)."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PLACEHOLDER = re.compile(r"\{(\w+)\}")


class RelevanceMode(StrEnum):
    """How margins are judged before they reach the final prompt."""

    # The margin's first token is YES or NO (forced); a NO margin is dropped at that token.
    FIRST_TOKEN = "first_token"
    # A separate greedy YES/NO turn judges each finished margin.
    CLASSIFIER = "classifier"
    # Every margin is kept.
    NONE = "none"


class GroundingMode(StrEnum):
    """What happens to a margin that its own segment does not support (`wim.grounding`)."""

    # A supported margin is replaced by the document sentence(s) that support it; others drop.
    SNAP = "snap"
    # A supported margin is kept in its own words; others drop.
    CHECK = "check"
    # Nothing is dropped for lack of support (the check still runs and is reported).
    OFF = "off"


def _placeholders(template: str) -> set[str]:
    return set(PLACEHOLDER.findall(template))


class PromptTemplates(BaseModel):
    """Every piece of wording the model sees. `{name}` marks a placeholder; other braces are text.

    Placeholder values (document, query, margins) are inserted as plain text and tokenized with
    special-token strings kept literal, so user text can never act as template syntax or as a
    chat control token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: str = (
        "You are a careful reader. You answer questions about a document using only what the "
        "document says."
    )
    # The document turn. Everything before {document} is shared by every request of a job.
    document: str = "Here is a document.\n<document>\n{document}\n</document>\n\n{instruction}"
    # Margin instruction for relevance modes `classifier` and `none`.
    margin: str = (
        "Question: {query}\n"
        "Do not answer the question yet. Write down, in one or two short sentences, only the facts "
        "stated in the document above that help answer it. If the document above states no such "
        "fact, write only: NO."
    )
    # Margin instruction for relevance mode `first_token`: the reply must open with YES or NO.
    margin_first_token: str = (
        "Question: {query}\n"
        "Is the answer to this question written in the document above? Reply YES or NO. If "
        "YES, also copy the sentence that gives the answer."
    )
    # The separate judging turn of relevance mode `classifier` (it sees no document).
    classifier: str = (
        "Question: {query}\nNote: {margin}\n"
        "Does the note state a fact that helps answer the question? Reply YES or NO."
    )
    # The final step, after the whole document.
    final: str = (
        "Notes taken while reading the document:\n{margins}\n\n"
        "Using the document and the notes, answer in one sentence: {query}"
    )
    margin_entry: str = "[segment {segment}] {text}"
    no_margins: str = "(none)"
    yes: str = "YES"
    no: str = "NO"

    @model_validator(mode="after")
    def _check_placeholders(self) -> PromptTemplates:
        required = {
            "document": {"document", "instruction"},
            "margin": {"query"},
            "margin_first_token": {"query"},
            "classifier": {"query", "margin"},
            "final": {"query", "margins"},
            "margin_entry": {"text"},
        }
        allowed_extra = {"margin_entry": {"segment"}}
        for name, needed in required.items():
            found = _placeholders(getattr(self, name))
            missing = needed - found
            unknown = found - needed - allowed_extra.get(name, set())
            if missing:
                raise ValueError(f"template {name!r} lacks placeholder(s) {sorted(missing)}")
            if unknown:
                raise ValueError(f"template {name!r} has unknown placeholder(s) {sorted(unknown)}")
        for name in ("system", "no_margins", "yes", "no"):
            if _placeholders(getattr(self, name)):
                raise ValueError(f"template {name!r} takes no placeholders")
        if not self.yes.strip() or not self.no.strip():
            raise ValueError("the relevance words must not be empty")
        return self


class WiMOptions(BaseModel):
    """How one job reads its document and answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    relevance: RelevanceMode = RelevanceMode.FIRST_TOKEN
    segment_tokens: int = Field(512, ge=32, le=65536, description="Target segment size in tokens.")
    max_segment_tokens: int | None = Field(
        None, ge=32, le=131072, description="Hard cap per segment (default 1.5 x target)."
    )
    margin_max_tokens: int = Field(48, ge=1, le=1024)
    answer_max_tokens: int = Field(64, ge=1, le=4096)
    grounding: GroundingMode = GroundingMode.SNAP
    grounding_min_coverage: float = Field(
        0.8, ge=0.0, le=1.0, description="Share of a margin's content words its evidence holds."
    )
    grounding_max_sentences: int = Field(
        2, ge=1, le=8, description="Most consecutive sentences one margin's evidence may span."
    )
    note_min_query_overlap: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the query's content words a note must contain to be kept.",
    )
    # Stop strings end a generation as soon as the decoded text contains one (not included).
    margin_stop: list[str] = Field(default_factory=lambda: ["\n\n"])
    answer_stop: list[str] = Field(default_factory=list)
    # Extra token ids that end generations, besides the model's end-of-turn/EOS ids.
    stop_token_ids: list[int] = Field(default_factory=list)
    prompts: PromptTemplates = Field(default_factory=PromptTemplates)

    @field_validator("margin_stop", "answer_stop")
    @classmethod
    def _non_empty_stops(cls, stops: list[str]) -> list[str]:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _check_sizes(self) -> WiMOptions:
        if self.max_segment_tokens is not None and self.max_segment_tokens < self.segment_tokens:
            raise ValueError("max_segment_tokens must be at least segment_tokens")
        return self

    @property
    def segment_cap(self) -> int:
        return self.max_segment_tokens or self.segment_tokens + self.segment_tokens // 2
