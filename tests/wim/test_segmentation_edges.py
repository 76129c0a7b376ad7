"""`segment_document`'s choice of cut at the edges of its window, on documents whose tokens are
their words (a fake tokenization: every cut is where a hand-counted sentence ends). Properties
on the real tokenizer are in test_segmentation.py."""

from __future__ import annotations

import re

import pytest

from wim_service.wim.segmentation import segment_document
from wim_service.wim.tokenizer import EncodedText


def words_document(lengths: list[int], tail: str = "") -> tuple[str, EncodedText]:
    """Sentences of `lengths` words; one token a word (its period included)."""
    text = " ".join(" ".join(["Word"] + ["word"] * (m - 1)) + "." for m in lengths) + tail
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    return text, EncodedText(ids=list(range(len(spans))), offsets=spans)


def first_cut(lengths: list[int], *, target: int, cap: int, block: int) -> int:
    text, encoded = words_document(lengths)
    segments = segment_document(
        text, encoded, target_tokens=target, max_tokens=cap, block_size=block, prefix_tokens=0
    )
    return segments[0].token_end


@pytest.mark.parametrize(
    ("lengths", "target", "cap", "block", "cut"),
    [
        # target 8, slack 2: ends at 6..10 tokens are in the window, the block-aligned one wins.
        ([9, 1, 9, 9], 8, 12, 10, 10),  # 10 = target + slack, on a block multiple
        ([6, 1, 9, 9], 8, 12, 6, 6),  # 6 = target - slack, on a block multiple
        ([9, 1, 9, 9], 8, 10, 10, 10),  # 10 is also the cap: still reachable
        ([7, 5, 9, 9], 8, 12, 6, 7),  # 12 is block-aligned but out of the window
        # target 3: slack at least 1, window 2..4; 5 is block-aligned but out of it.
        ([4, 1, 9, 9], 3, 6, 5, 4),
        # A one-token first sentence: a cut after token 1 is clean.
        ([1, 9, 9], 1, 2, 16, 1),
    ],
)
def test_the_cut_is_the_block_aligned_sentence_end_within_the_window(
    lengths: list[int], target: int, cap: int, block: int, cut: int
) -> None:
    assert first_cut(lengths, target=target, cap=cap, block=block) == cut


def test_a_sentence_end_before_trailing_space_is_no_cut() -> None:
    text, encoded = words_document([3, 3], tail="  ")
    segments = segment_document(
        text, encoded, target_tokens=4, max_tokens=6, block_size=16, prefix_tokens=0
    )
    assert [(s.token_start, s.token_end, s.char_end) for s in segments] == [(0, 6, len(text))]


def test_among_block_aligned_ends_the_one_nearest_the_target_wins() -> None:
    # Blocks of 2: every end in the window (6..10 tokens past the last cut) is aligned; the
    # one 8 tokens on wins each time.
    text, encoded = words_document([6, 2] * 4)
    segments = segment_document(
        text, encoded, target_tokens=8, max_tokens=12, block_size=2, prefix_tokens=0
    )
    assert [s.token_end for s in segments] == [8, 16, 24, 32]


def test_with_no_end_in_the_window_the_reachable_one_nearest_the_target_wins() -> None:
    # Ends 3 and 11 tokens past each cut, none within 6..10: 11 is nearer 8 than 3 is.
    text, encoded = words_document([3, 8, 3, 8, 9])
    segments = segment_document(
        text, encoded, target_tokens=8, max_tokens=12, block_size=16, prefix_tokens=0
    )
    assert [s.token_end for s in segments] == [11, 22, 31]


def test_no_cut_splits_a_character_two_tokens_share() -> None:
    # Byte-level BPE: the token after "one." starts inside the previous one, which ends one
    # character past the sentence end; the next clean end is after "two.".
    text = "Word one. Word two. Word three."
    offsets = [(0, 4), (5, 10), (9, 14), (15, 19), (20, 24), (25, 31)]
    encoded = EncodedText(ids=list(range(len(offsets))), offsets=offsets)
    segments = segment_document(
        text, encoded, target_tokens=2, max_tokens=4, block_size=16, prefix_tokens=0
    )
    assert [s.token_end for s in segments] == [4, 6]
