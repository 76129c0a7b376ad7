"""A planned document in its engine context: what every query over it reads.

`PinnedDocument` ties the document's plan and prompts to the context that holds its KV, and
builds the requests that read that context: stop tokens, the final prompt within the window,
and the answer branch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from wim_service.wim.backend import (
    ContextSession,
    EngineLimits,
    GenerationChunk,
    GenerationParams,
    RequestKind,
)
from wim_service.wim.grounding import SegmentText
from wim_service.wim.options import WiMOptions
from wim_service.wim.plan import DocumentPlan, relevance_ids
from wim_service.wim.prompts import MarginNote, PromptBuilder


@dataclass(frozen=True)
class PinnedDocument:
    """One document read (or being read) into one engine context."""

    builder: PromptBuilder
    plan: DocumentPlan
    context: ContextSession
    limits: EngineLimits
    yes_ids: frozenset[int]  # first tokens of a relevant margin
    no_ids: frozenset[int]
    # Each segment's sentences, parsed on first use and kept for every later query.
    segment_texts: list[SegmentText]

    @classmethod
    def of(
        cls,
        builder: PromptBuilder,
        plan: DocumentPlan,
        context: ContextSession,
        limits: EngineLimits,
    ) -> PinnedDocument:
        yes_ids, no_ids = relevance_ids(builder)
        segment_texts = [SegmentText(plan.text, s) for s in plan.segments]
        return cls(builder, plan, context, limits, yes_ids, no_ids, segment_texts)

    def stop_ids(self, options: WiMOptions) -> frozenset[int]:
        return self.builder.tokenizer.eos_token_ids | frozenset(options.stop_token_ids)

    def final_suffix(
        self, query: str, notes: list[MarginNote], options: WiMOptions
    ) -> tuple[list[int], list[MarginNote]]:
        """The final prompt after the document, and the notes the window leaves room for."""
        budget = self.limits.max_model_len - self.plan.context_tokens - options.answer_max_tokens
        return self.builder.final_suffix_within(query, notes, budget)

    def answer_params(self, options: WiMOptions) -> GenerationParams:
        return GenerationParams(
            kind=RequestKind.ANSWER,
            max_tokens=options.answer_max_tokens,
            stop_token_ids=self.stop_ids(options),
        )

    def answer_branch(
        self, suffix: list[int], options: WiMOptions
    ) -> AsyncIterator[GenerationChunk]:
        """An answer over the whole context, as a branch: the context stays the document."""
        return self.context.branch(self.plan.context_tokens, suffix, self.answer_params(options))
