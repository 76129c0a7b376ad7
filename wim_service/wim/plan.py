"""Everything a job does before engine work: plan the document, refuse what cannot run.

A `DocumentPlan` is the document tokenized once and cut into segments; the checks here refuse
a document, a query or options that validate but cannot run (too long for the window, words
the tokenizer cannot tell apart), so that no engine work is spent on a job bound to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from wim_service.wim.backend import EngineLimits
from wim_service.wim.capacity import JobShape
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder, TemplateError
from wim_service.wim.segmentation import Segment, segment_document
from wim_service.wim.tokenizer import EncodedText


@dataclass(frozen=True)
class DocumentPlan:
    """A document tokenized once and cut into segments, with the prompt prefix before it."""

    text: str
    encoded: EncodedText
    prefix_ids: list[int]
    segments: list[Segment]

    @property
    def context_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.encoded.ids)

    def context_ids(self, end: int) -> list[int]:
        """Prompt tokens up to document token `end` (the prefix included)."""
        return self.prefix_ids + self.encoded.ids[:end]

    def shape(self, builder: PromptBuilder, options: WiMOptions, query: str | None) -> JobShape:
        """The worst case of a job on this document (`query=None`: a query not known yet)."""
        try:
            return JobShape.of(
                builder,
                context_tokens=self.context_tokens,
                document_tokens=len(self.encoded.ids),
                segments=len(self.segments),
                options=options,
                query=query,
            )
        except TemplateError as exc:  # templates the chat template renders inconsistently
            raise WiMError(ErrorCode.INVALID_INPUT, f"options.prompts: {exc}") from exc


def plan_document(
    builder: PromptBuilder, document: str, options: WiMOptions, limits: EngineLimits
) -> DocumentPlan:
    if not document.strip():
        raise WiMError(ErrorCode.INVALID_INPUT, "the document is empty")
    encoded = builder.tokenizer.encode_user_text(document)
    if not encoded.ids:  # characters the tokenizer drops (some control characters) only
        raise WiMError(ErrorCode.INVALID_INPUT, "the document has no text the model reads")
    prefix = builder.context_prefix
    if len(prefix) + len(encoded.ids) >= limits.max_model_len:
        raise WiMError(
            ErrorCode.TOO_LONG,
            f"the document is {len(encoded.ids)} tokens; with the {len(prefix)}-token prompt "
            f"prefix it does not fit the model's {limits.max_model_len}-token context window",
        )
    segments = segment_document(
        document,
        encoded,
        target_tokens=options.segment_tokens,
        max_tokens=options.segment_cap,
        block_size=limits.block_size,
        prefix_tokens=len(prefix),
    )
    return DocumentPlan(document, encoded, prefix, segments)


def relevance_ids(builder: PromptBuilder) -> tuple[frozenset[int], frozenset[int]]:
    """The YES and NO first tokens; templates whose words cannot be told apart are refused."""
    try:
        return builder.relevance_token_ids()
    except TemplateError as exc:
        raise WiMError(ErrorCode.INVALID_INPUT, f"prompts.yes / prompts.no: {exc}") from exc


def check_options(builder: PromptBuilder, options: WiMOptions) -> None:
    """Refuse options that validate but cannot run with this tokenizer, before any engine work."""
    relevance_ids(builder)
    vocab = builder.tokenizer.vocab_size
    outside = sorted({i for i in options.stop_token_ids if i >= vocab})
    if outside:
        raise WiMError(
            ErrorCode.INVALID_INPUT,
            f"stop_token_ids {outside} are outside the model's vocabulary (ids 0-{vocab - 1})",
        )


def check_query(
    plan: DocumentPlan,
    builder: PromptBuilder,
    limits: EngineLimits,
    query: str,
    options: WiMOptions,
) -> JobShape:
    """Refuse a query that cannot run, before any engine work; returns its worst case."""
    if not query.strip():
        raise WiMError(ErrorCode.INVALID_INPUT, "the query is empty")
    check_options(builder, options)
    shape = plan.shape(builder, options, query)
    shape.check_window(limits.max_model_len)
    return shape


def prepare_job(
    builder: PromptBuilder,
    document: str,
    options: WiMOptions,
    limits: EngineLimits,
    query: str | None = None,
) -> tuple[DocumentPlan, JobShape]:
    """Everything before engine work: plan the document, refuse what cannot run, size the job
    (`query=None`: a document session, its queries not known yet).

    Tokenizing and segmenting a long document is CPU work: the entry points run this in a
    thread, so that the event loop keeps serving other jobs (and an engine replica's load polls).
    """
    plan = plan_document(builder, document, options, limits)
    if query is not None:
        return plan, check_query(plan, builder, limits, query, options)
    check_options(builder, options)
    shape = plan.shape(builder, options, None)
    shape.check_window(limits.max_model_len)
    return plan, shape
