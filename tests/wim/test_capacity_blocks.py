"""The capacity model's arithmetic (`wim.capacity`) on small hand-computed shapes: every token
and KV-block count exact, at the block boundaries where an off-by-one would show. What the
engine really allocates against these counts is checked in tests/wim/test_capacity.py."""

from __future__ import annotations

from functools import cached_property

import pytest

from wim_service.wim.capacity import JobShape, largest_document
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.prompts import MarginNote, PromptBuilder

BLOCK = 16
WIDE = 4096  # a window that caps nothing


def shape(
    *,
    context: int,
    segments: int,
    margin_prompt: int,
    margin_max: int,
    document: int = 0,
    classifier_prompt: int = 0,
    final_prompt: int = 0,
    note_overhead: int = 0,
    answer_max: int = 0,
) -> JobShape:
    return JobShape(
        context_tokens=context,
        document_tokens=document,
        segments=segments,
        margin_prompt_tokens=margin_prompt,
        classifier_prompt_tokens=classifier_prompt,
        final_prompt_tokens=final_prompt,
        note_overhead_tokens=note_overhead,
        margin_max_tokens=margin_max,
        answer_max_tokens=answer_max,
    )


@pytest.mark.parametrize(
    ("margin_prompt", "classifier_prompt", "per_margin"),
    [
        # A branch re-reads the partial block at its segment's end: up to 15 tokens + its own.
        (22, 0, 3),  # 15 + 22 + 10 = 47 tokens: 3 blocks
        (23, 0, 3),  # 48: exactly 3 blocks
        (24, 0, 4),  # 49: one token into a 4th
        (23, 97, 7),  # the classifier turn, 97 tokens, needs 7 blocks: the larger counts
    ],
)
def test_each_margin_branch_takes_its_blocks_and_a_query_all_of_them(
    margin_prompt: int, classifier_prompt: int, per_margin: int
) -> None:
    # Two segments; a window 10 tokens past the context keeps the answer branch small
    # (15 + 10 tokens: 2 blocks), so that the margins decide.
    job = shape(
        context=100,
        segments=2,
        margin_prompt=margin_prompt,
        margin_max=10,
        classifier_prompt=classifier_prompt,
    )
    assert job.query_blocks(BLOCK, 110) == 2 * per_margin
    # The pinned context: 100 tokens + the one a push samples = 101, 7 blocks.
    assert job.session_blocks(BLOCK, 110) == 7 + 2 * per_margin


@pytest.mark.parametrize(
    ("answer_max", "window", "answer_blocks"),
    [
        (7, WIDE, 6),  # final 20 + notes 54 + answer 7 = 81; 15 + 81 = 96: exactly 6 blocks
        (8, WIDE, 7),  # 82 tokens: 97, into a 7th block
        (8, 165, 5),  # the window leaves 65 tokens after the context: 15 + 65 = 80, 5 blocks
    ],
)
def test_the_answer_branch_holds_prompt_notes_and_answer_up_to_the_window(
    answer_max: int, window: int, answer_blocks: int
) -> None:
    # One segment whose margin branch is small (15 + 2 tokens: 2 blocks). Notes at their
    # largest: 1 x (overhead 3 + margin 1) + the document's 50 tokens = 54.
    job = shape(
        context=100,
        document=50,
        segments=1,
        margin_prompt=1,
        margin_max=1,
        final_prompt=20,
        note_overhead=3,
        answer_max=answer_max,
    )
    assert job.notes_tokens == 54
    assert job.query_blocks(BLOCK, window) == answer_blocks


@pytest.mark.parametrize(
    ("context", "window", "blocks"),
    [
        # Reading: context + 1 = 128 tokens (8 blocks) + 4 margins x 3 blocks; the final step
        # after it (the window leaves 3 tokens) needs ceil(130 / 16) = 9.
        (127, 130, 8 + 12),
        (128, 131, 9 + 12),  # 129 tokens: a 9th context block
    ],
)
def test_a_one_shot_job_holds_its_context_and_every_margin_while_reading(
    context: int, window: int, blocks: int
) -> None:
    job = shape(context=context, segments=4, margin_prompt=23, margin_max=10)
    assert job.one_shot_blocks(BLOCK, window) == blocks


def test_a_one_shot_jobs_final_step_is_appended_to_its_context() -> None:
    job = shape(
        context=96,
        document=50,
        segments=1,
        margin_prompt=1,
        margin_max=1,
        final_prompt=20,
        note_overhead=3,
        answer_max=8,
    )
    assert (job.margin_request_tokens, job.plain_final_tokens) == (98, 124)
    # Reading: 97 tokens (7 blocks) + one 2-block margin = 9. Final: 96 + 20 + 54 + 8 = 178
    # tokens, 12 blocks.
    assert job.one_shot_blocks(BLOCK, WIDE) == 12


# What each relevance mode's margin instruction adds (LengthsBuilder).
RELEVANCE_TOKENS = {
    RelevanceMode.FIRST_TOKEN: 2,
    RelevanceMode.CLASSIFIER: 1,
    RelevanceMode.NONE: 0,
}


def test_a_job_that_exactly_fills_the_window_fits() -> None:
    # The margin request decides: 100 + 20 + 10 = 130 tokens (the final one: 100 + 5 + 5).
    job = shape(
        context=100, segments=2, margin_prompt=20, margin_max=10, final_prompt=5, answer_max=5
    )
    job.check_window(130)
    with pytest.raises(WiMError) as refused:
        job.check_window(129)
    assert refused.value.code == ErrorCode.TOO_LONG
    assert "needs up to 130 tokens; the model's context window is 129." in refused.value.message
    assert refused.value.message.endswith("lower margin_max_tokens / answer_max_tokens.")


class LengthsBuilder(PromptBuilder):
    """Prompts of known lengths (every token id 0): a base length plus the characters of the
    query and of the margin, or 10 tokens a note. Nothing is rendered or tokenized."""

    def __init__(self) -> None:
        pass  # no tokenizer, no templates

    @cached_property
    def context_prefix(self) -> list[int]:
        return [0] * 7

    def margin_suffix(self, query: str, relevance: RelevanceMode) -> list[int]:
        return [0] * (20 + len(query) + RELEVANCE_TOKENS[relevance])

    def final_suffix(self, query: str, margins: list[MarginNote]) -> list[int]:
        return [0] * (30 + len(query) + 10 * len(margins))

    def classifier_prompt(self, query: str, margin: str) -> list[int]:
        return [0] * (40 + len(query) + len(margin))

    def margin_entry_overhead(self) -> int:
        return 6


QUERY = "abcd"  # 4 characters: 4 tokens of LengthsBuilder


def shape_of(options: WiMOptions, query: str | None) -> JobShape:
    return JobShape.of(
        LengthsBuilder(),
        context_tokens=300,
        document_tokens=293,
        segments=3,
        options=options,
        query=query,
    )


def test_a_jobs_shape_counts_its_query_and_a_margin_for_its_edges() -> None:
    options = WiMOptions(
        relevance=RelevanceMode.FIRST_TOKEN, margin_max_tokens=50, answer_max_tokens=60
    )
    # Each prompt + 4 tokens for merges at the query's edges; first_token relevance: +2.
    assert shape_of(options, QUERY) == JobShape(
        context_tokens=300,
        document_tokens=293,
        segments=3,
        margin_prompt_tokens=20 + 4 + 2 + 4,
        classifier_prompt_tokens=0,
        final_prompt_tokens=30 + 4 + 4,
        note_overhead_tokens=6,
        margin_max_tokens=50,
        answer_max_tokens=60,
    )
    # A document session read before its query: room for a query of up to 256 tokens.
    unknown = shape_of(options, None)
    assert (unknown.margin_prompt_tokens, unknown.final_prompt_tokens) == (20 + 2 + 256, 30 + 256)
    # A classifier judges a margin of up to 50 tokens in its own turn.
    judged = shape_of(options.model_copy(update={"relevance": RelevanceMode.CLASSIFIER}), QUERY)
    assert judged.classifier_prompt_tokens == 40 + 4 + 50 + 4
    assert judged.margin_prompt_tokens == 20 + 4 + 1 + 4


@pytest.mark.parametrize(
    ("margin_max", "answer_max", "query", "largest"),
    [
        # context prefix 7; the answer's request decides: 7 + (30 + 4 + 4) + 60 = 105
        (50, 60, QUERY, 1000 - 105),
        # the margin's decides: 7 + (20 + 4 + 2 + 4) + 80 = 117
        (80, 40, QUERY, 1000 - 117),
        # no query yet: 7 + (30 + 256) + 60 = 353
        (50, 60, None, 1000 - 353),
    ],
)
def test_the_largest_document_leaves_room_for_its_longest_request(
    margin_max: int, answer_max: int, query: str | None, largest: int
) -> None:
    options = WiMOptions(
        relevance=RelevanceMode.FIRST_TOKEN,
        margin_max_tokens=margin_max,
        answer_max_tokens=answer_max,
    )
    assert largest_document(LengthsBuilder(), options, 1000, query) == largest
