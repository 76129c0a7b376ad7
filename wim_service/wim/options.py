"""Per-job options, validated at the edge (CLI flags, HTTP bodies, Python callers alike)."""

from __future__ import annotations

import re
from collections import Counter
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

PLACEHOLDER = re.compile(r"\{(\w+)\}")

# Input limits: one place for every cap the option models enforce (a larger value is a
# validation error, HTTP 422 at the edge). They bound the work one request can ask for.
MAX_TEMPLATE_CHARS = 4096  # each prompt template
MAX_STOP_STRINGS = 16  # per stop list (margin_stop, answer_stop)
MAX_STOP_STRING_CHARS = 128  # each stop string
MAX_STOP_TOKEN_IDS = 64
# Private-use code points (BMP): `wim.prompts` marks template slots and chat turns with them,
# so templates may not contain any.
PRIVATE_USE = re.compile("[\ue000-\uf8ff]")


def _utf8(text: str) -> str:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


def _no_private_use(text: str) -> str:
    if found := PRIVATE_USE.search(text):
        raise ValueError(
            f"private-use character U+{ord(found.group()):04X} at character {found.start()}: "
            "templates may not contain U+E000-U+F8FF"
        )
    return text


# Any text a client sends (document, query, templates, stops): valid Unicode, encodable as UTF-8.
Utf8Text = Annotated[str, AfterValidator(_utf8)]
# Length bounds come before the validators, so that pydantic checks them as string lengths.
TemplateText = Annotated[
    str,
    Field(
        max_length=MAX_TEMPLATE_CHARS,
        description=f"At most {MAX_TEMPLATE_CHARS} characters; each placeholder exactly once; "
        "no private-use characters (U+E000-U+F8FF).",
    ),
    AfterValidator(_utf8),
    AfterValidator(_no_private_use),
]
StopString = Annotated[
    str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_utf8)
]
StopList = Annotated[
    list[StopString],
    Field(
        max_length=MAX_STOP_STRINGS,
        description="Stop strings end a generation as soon as the decoded text contains one "
        f"(not included): at most {MAX_STOP_STRINGS}, each 1-{MAX_STOP_STRING_CHARS} characters.",
    ),
]


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


def _placeholders(template: str) -> Counter[str]:
    return Counter(PLACEHOLDER.findall(template))


class PromptTemplates(BaseModel):
    """Every piece of wording the model sees. `{name}` marks a placeholder; other braces are text.

    Placeholder values (document, query, margins) are inserted as plain text and tokenized with
    special-token strings kept literal, so user text can never act as template syntax or as a
    chat control token. Template text itself is tokenized the same way (unless the operator
    allows special tokens in templates): only the model's chat template adds control tokens.
    Each template is at most `MAX_TEMPLATE_CHARS` characters, holds each of its placeholders
    exactly once and no private-use character.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: TemplateText = (
        "You are a careful reader. You answer questions about a document using only what the "
        "document says."
    )
    # The document turn. Everything before {document} is shared by every request of a job.
    document: TemplateText = (
        "Here is a document.\n<document>\n{document}\n</document>\n\n{instruction}"
    )
    # Margin instruction for relevance modes `classifier` and `none`. Extractive and short: it
    # is prefilled once per segment, and grounding keeps a margin only as the segment's own
    # sentences anyway. It scored as the longer "write down only the facts stated..." wording
    # did on every task of docs/evaluation.md, with 26 fewer prompt tokens per margin.
    margin: TemplateText = (
        "Question: {query}\nCopy the sentence above that helps answer it. If none does, write "
        "only: NO."
    )
    # Margin instruction for relevance mode `first_token`: the reply must open with YES or NO.
    margin_first_token: TemplateText = (
        "Question: {query}\n"
        "Is the answer to this question written in the document above? Reply YES or NO. If "
        "YES, also copy the sentence that gives the answer."
    )
    # The separate judging turn of relevance mode `classifier` (it sees no document).
    classifier: TemplateText = (
        "Question: {query}\nNote: {margin}\n"
        "Does the note state a fact that helps answer the question? Reply YES or NO."
    )
    # The final step, after the whole document.
    final: TemplateText = (
        "Notes taken while reading the document:\n{margins}\n\n"
        "Using the document and the notes, answer in one sentence: {query}"
    )
    margin_entry: TemplateText = "[segment {segment}] {text}"
    no_margins: TemplateText = "(none)"
    yes: TemplateText = "YES"
    no: TemplateText = "NO"

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
            missing = needed - found.keys()
            unknown = found.keys() - needed - allowed_extra.get(name, set())
            repeated = sorted(p for p, n in found.items() if n > 1)
            if missing:
                raise ValueError(f"template {name!r} lacks placeholder(s) {sorted(missing)}")
            if unknown:
                raise ValueError(f"template {name!r} has unknown placeholder(s) {sorted(unknown)}")
            if repeated:
                # Each slot is filled once: the prompt split and the KV sizing count it once.
                raise ValueError(f"template {name!r} repeats placeholder(s) {repeated}")
        if self.document.index("{instruction}") < self.document.index("{document}"):
            # Everything before {document} must be the same for every request of a job.
            raise ValueError("template 'document' must place {instruction} after {document}")
        for name in ("system", "no_margins", "yes", "no"):
            if _placeholders(getattr(self, name)):
                raise ValueError(f"template {name!r} takes no placeholders")
        if not self.yes.strip() or not self.no.strip():
            raise ValueError("the relevance words must not be empty")
        return self


class WiMOptions(BaseModel):
    """How one job reads its document and answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `none`: on the default model the 135M judge drops needed margins and keeps invented
    # ones; grounding (below) is the filter that works. Measured in docs/evaluation.md.
    relevance: RelevanceMode = RelevanceMode.NONE
    segment_tokens: int = Field(512, ge=32, le=65536, description="Target segment size in tokens.")
    max_segment_tokens: int | None = Field(
        None, ge=32, le=131072, description="Hard cap per segment (default 1.5 x target)."
    )
    margin_max_tokens: int = Field(48, ge=1, le=1024)
    # 1: the margin instruction asks for one sentence copied from the segment; on the default
    # model the text after it never changed a kept note (docs/evaluation.md) and only kept
    # the job waiting for margins that ramble on.
    margin_max_sentences: int | None = Field(
        1,
        ge=1,
        le=64,
        description="A margin ends after this many sentences (null: no limit besides "
        "margin_max_tokens and margin_stop).",
    )
    answer_max_tokens: int = Field(64, ge=1, le=4096)
    grounding: GroundingMode = GroundingMode.SNAP
    grounding_min_coverage: float = Field(
        0.8, ge=0.0, le=1.0, description="Share of a margin's content words its evidence holds."
    )
    grounding_max_sentences: int = Field(
        2, ge=1, le=8, description="Most consecutive sentences one margin's evidence may span."
    )
    # 0.8: on the default model every note that made an answer worse than plain's shared
    # (almost) nothing with the question (a grounded filler or distractor sentence); at 0.8 no
    # task of `wim eval --full` was worse than plain. Lexical: a paraphrased question may drop
    # a useful note (the answer is then plain's). Measured in docs/evaluation.md.
    note_min_query_overlap: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Share of the query's content words a note must contain to be kept.",
    )
    # With snapping, a note is a window of its segment's sentences and must share
    # `note_min_query_overlap` of the query: a segment without such a window can keep no
    # margin, so writing one only costs its prompt and decode steps.
    skip_unmatched_segments: bool = Field(
        True,
        description="Write no margin for a segment in which no window of "
        "`grounding_max_sentences` sentences holds `note_min_query_overlap` of the query's "
        "content words: with grounding `snap` such a margin is dropped whatever it says, so "
        "the answer is the same. No effect with grounding `check` or `off`, or an overlap of 0.",
    )
    answer_early: bool = Field(
        True,
        description="Start the answer while the last margins are still being written and hold "
        "its text back: over the notes kept so far and, with grounding `snap`, also over those "
        "plus the sentence each running margin is expected to copy (while what it has written "
        "still fits that sentence). One is stopped as soon as a margin ends otherwise than it "
        "assumed, and the one over what is expected then starts; the one whose notes turn out "
        "right stands, else the answer starts over with every note. The answer is the same "
        "either way.",
    )
    margin_stop: StopList = Field(default_factory=lambda: ["\n\n"])
    answer_stop: StopList = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Extra token ids that end generations, besides the model's end-of-turn/EOS "
        f"ids: at most {MAX_STOP_TOKEN_IDS}, each in the model's vocabulary.",
    )
    prompts: PromptTemplates = Field(
        default_factory=PromptTemplates,
        description=f"Prompt wording: each template at most {MAX_TEMPLATE_CHARS} characters, "
        "each placeholder exactly once, no private-use characters (U+E000-U+F8FF).",
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> WiMOptions:
        if self.max_segment_tokens is not None and self.max_segment_tokens < self.segment_tokens:
            raise ValueError("max_segment_tokens must be at least segment_tokens")
        return self

    @property
    def segment_cap(self) -> int:
        return self.max_segment_tokens or self.segment_tokens + self.segment_tokens // 2
