"""How much a WiM job can take: tokens in the context window, KV blocks in the engine.

One place computes the worst case of every request a job makes, so that the orchestrator's
length guard, the engine's KV reservation, the router's placement and `wim eval`'s document
sizes agree. The requests of a job (see `orchestrator.py`):

* the *context* (the document behind its prompt prefix), pinned for the job's life;
* one *margin* branch per segment, all possibly in flight at once: it re-reads the partial KV
  block at its segment's end (full blocks are cache hits on the context), then its instruction
  and up to `margin_max_tokens`; with relevance `classifier` a stand-alone judging turn follows;
* the *final* step: the document, the final prompt with the kept notes (budgeted to what the
  window leaves) and up to `answer_max_tokens`. A one-shot job appends it to the context; a
  document session runs it as a branch, so that the context stays equal to the document. An
  answer started early (`answer_early`) is a branch beside the last margins, taken only if
  it fits in what the job reserved for its margins or its final step.

Every count is an upper bound: a reservation taken from it is never exceeded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.prompts import PromptBuilder

# Room kept for a query's tokens when a document session is read before any query is known.
QUERY_RESERVE_TOKENS = 256
# A document session's query runs beside the one in its turn, in KV blocks of its own, only
# if this share of the engine's KV stays free after it (`EngineConfig.side_by_side_kv_reserve`,
# `wim sim --side-by-side-kv-reserve`). Blocks taken so at saturation are the blocks a new
# session or a plain request would have needed: with 5% kept free, `wim sim` of hot-document
# traces at 8 replicas answered more within the deadline (docs/routing.md). 0: whenever free.
DEFAULT_SIDE_BY_SIDE_KV_RESERVE = 0.05
# A query's text is tokenized inside its prompt; merges at its edges may differ by a token or
# two from the query tokenized alone.
_EDGE_TOKENS = 4


def kept_free_blocks(capacity_blocks: int, side_by_side_kv_reserve: float) -> int:
    """The KV blocks of an engine of `capacity_blocks` that a side-by-side query must leave
    free: the reserve's share, rounded up (at least that share stays free)."""
    return math.ceil(capacity_blocks * side_by_side_kv_reserve)


@dataclass(frozen=True)
class JobShape:
    """The sizes that bound a job, in tokens."""

    context_tokens: int  # prompt prefix + document
    document_tokens: int
    segments: int
    margin_prompt_tokens: int  # the margin instruction after the document (query included)
    classifier_prompt_tokens: int  # the judging turn (0 unless relevance is `classifier`)
    final_prompt_tokens: int  # the final instruction without notes (query included)
    note_overhead_tokens: int  # what one note's entry adds around its text
    margin_max_tokens: int
    answer_max_tokens: int

    @classmethod
    def of(
        cls,
        builder: PromptBuilder,
        *,
        context_tokens: int,
        document_tokens: int,
        segments: int,
        options: WiMOptions,
        query: str | None = None,
    ) -> JobShape:
        """The shape of a job on a document; `query=None` sizes for a query not known yet."""
        if query is None:
            extra, query = QUERY_RESERVE_TOKENS, ""
        else:
            extra = _EDGE_TOKENS
        classifier = 0
        if options.relevance is RelevanceMode.CLASSIFIER:
            # The judged margin is at most margin_max_tokens long.
            classifier = (
                len(builder.classifier_prompt(query, "")) + options.margin_max_tokens + extra
            )
        return cls(
            context_tokens=context_tokens,
            document_tokens=document_tokens,
            segments=segments,
            margin_prompt_tokens=len(builder.margin_suffix(query, options.relevance)) + extra,
            classifier_prompt_tokens=classifier,
            final_prompt_tokens=len(builder.final_suffix(query, [])) + extra,
            note_overhead_tokens=builder.margin_entry_overhead(),
            margin_max_tokens=options.margin_max_tokens,
            answer_max_tokens=options.answer_max_tokens,
        )

    # -- the context window ----------------------------------------------------------------

    @property
    def margin_request_tokens(self) -> int:
        """The longest margin request: the whole document, instruction, margin."""
        return self.context_tokens + self.margin_prompt_tokens + self.margin_max_tokens

    @property
    def plain_final_tokens(self) -> int:
        """The final request without notes: what the window must hold at the least."""
        return self.context_tokens + self.final_prompt_tokens + self.answer_max_tokens

    @property
    def notes_tokens(self) -> int:
        """Every note at its largest: a margin, or the segment sentences it was snapped to."""
        per_note = self.note_overhead_tokens + self.margin_max_tokens
        return self.segments * per_note + self.document_tokens

    def check_window(self, max_model_len: int) -> None:
        """Refuse a job whose requests cannot fit the window, before any engine work.

        The notes do not count: the final step takes only as many as the window leaves.
        """
        worst = max(self.margin_request_tokens, self.plain_final_tokens)
        if worst > max_model_len:
            raise WiMError(
                ErrorCode.TOO_LONG,
                f"the document ({self.context_tokens} tokens with the prompt prefix) with the "
                f"query, a margin of up to {self.margin_max_tokens} tokens or an answer of up "
                f"to {self.answer_max_tokens} tokens needs up to {worst} tokens; the model's "
                f"context window is {max_model_len}. Send a shorter document or query, or "
                "lower margin_max_tokens / answer_max_tokens.",
            )

    # -- KV blocks -------------------------------------------------------------------------

    def _final_tokens(self, max_model_len: int) -> int:
        """Final prompt, notes and answer after the document (the window caps the notes)."""
        wanted = self.final_prompt_tokens + self.notes_tokens + self.answer_max_tokens
        return min(wanted, max(0, max_model_len - self.context_tokens))

    def _margin_blocks(self, block: int) -> int:
        """New blocks of one margin branch, its classifier turn counted if larger."""
        branch = math.ceil((block - 1 + self.margin_prompt_tokens + self.margin_max_tokens) / block)
        classifier = math.ceil(self.classifier_prompt_tokens / block)
        return max(branch, classifier)

    def context_blocks(self, block: int) -> int:
        """The pinned context (+1: the token a push samples before the next push)."""
        return math.ceil((self.context_tokens + 1) / block)

    def query_blocks(self, block: int, max_model_len: int) -> int:
        """What one query adds over a pinned context: its margins, then its answer branch."""
        margins = self.segments * self._margin_blocks(block)
        answer = math.ceil((block - 1 + self._final_tokens(max_model_len)) / block)
        return max(margins, answer)

    def early_answer_blocks(
        self, block: int, pending_margins: int, suffix_tokens: Sequence[int]
    ) -> int:
        """Answer branches with final prompts of `suffix_tokens` tokens, started while
        `pending_margins` margins still run, together with those margins."""
        answers = sum(
            math.ceil((block - 1 + tokens + self.answer_max_tokens) / block)
            for tokens in suffix_tokens
        )
        return pending_margins * self._margin_blocks(block) + answers

    def one_shot_blocks(self, block: int, max_model_len: int) -> int:
        """A one-shot job: the context with every margin in flight, then the context with the
        final prompt and answer appended (the margins have ended by then)."""
        reading = self.context_blocks(block) + self.segments * self._margin_blocks(block)
        final = math.ceil((self.context_tokens + self._final_tokens(max_model_len)) / block)
        return max(reading, final)

    def session_blocks(self, block: int, max_model_len: int) -> int:
        """A document session: its context plus one query's additions."""
        return self.context_blocks(block) + self.query_blocks(block, max_model_len)


def largest_document(
    builder: PromptBuilder, options: WiMOptions, max_model_len: int, query: str | None = None
) -> int:
    """The most document tokens a job can take in a `max_model_len` window."""
    shape = JobShape.of(
        builder,
        context_tokens=len(builder.context_prefix),
        document_tokens=0,
        segments=1,
        options=options,
        query=query,
    )
    return max_model_len - max(shape.margin_request_tokens, shape.plain_final_tokens)
