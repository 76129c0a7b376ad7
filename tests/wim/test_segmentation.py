"""Segmentation invariants on the real default tokenizer and real punkt data."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wim_service.wim.segmentation import (
    _token_boundaries,
    leading_sentences,
    segment_document,
    sentence_ends,
)

WORDS = st.sampled_from(
    [
        "the",
        "harbour",
        "Dr.",
        "gate",
        "code",
        "4417",
        "U.S.",
        "naïve",
        "café",
        "e.g.",
        "{x}",
        "```",
        "<|im_end|>",
        "日本",
        "🙂",
        "—",
        "Mr.",
        "p.m.",
        "a",
        "said",
    ]
)
SENTENCE = st.builds(
    lambda words, end: " ".join(words) + end,
    st.lists(WORDS, min_size=1, max_size=30),
    st.sampled_from([".", "!", "?", ".\n", ".\n\n", "", ";"]),
)
DOCUMENT = st.builds(lambda s: " ".join(s), st.lists(SENTENCE, min_size=1, max_size=60))


def _segment(tokenizer, text: str, target: int, cap: int, block: int = 32, prefix: int = 37):
    encoded = tokenizer.encode_user_text(text)
    return encoded, segment_document(
        text,
        encoded,
        target_tokens=target,
        max_tokens=cap,
        block_size=block,
        prefix_tokens=prefix,
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=DOCUMENT, target=st.integers(8, 200), extra=st.integers(0, 100))
def test_segments_are_an_exact_partition(tokenizer, text: str, target: int, extra: int) -> None:
    if not text.strip():
        return
    encoded, segments = _segment(tokenizer, text, target, target + extra)
    # Token ids: the segments concatenate to exactly the whole-document tokenization.
    joined = [t for s in segments for t in encoded.ids[s.token_start : s.token_end]]
    assert joined == encoded.ids
    # Characters: the spans tile the document, nothing lost or repeated.
    assert "".join(text[s.char_start : s.char_end] for s in segments) == text
    assert segments[0].char_start == 0 and segments[-1].char_end == len(text)
    for a, b in itertools.pairwise(segments):
        assert a.token_end == b.token_start and a.char_end == b.char_start
    # No segment above the cap, none empty.
    assert all(0 < s.num_tokens <= target + extra for s in segments)
    # Each segment's tokens decode to the text of its span.
    for s in segments:
        assert (
            tokenizer.decode(encoded.ids[s.token_start : s.token_end])
            == text[s.char_start : s.char_end]
        )


def test_cuts_fall_on_sentence_ends_and_prefer_block_boundaries(tokenizer, report: str) -> None:
    encoded, segments = _segment(tokenizer, report, target=192, cap=288, block=32, prefix=37)
    ends = set(sentence_ends(report))
    assert len(segments) >= 5
    for s in segments[:-1]:
        assert s.char_end in ends or report[s.char_end - 1] in ".!?\n"
        assert report[: s.char_end].rstrip()[-1] in ".!?:"
    # Among the sentence ends in the target window, the cut recomputes the fewest tokens
    # past a KV block boundary.
    cuts = sorted(_token_boundaries(encoded, sorted(ends)))
    for s in segments[:-1]:
        window = [k for k in cuts if 192 - 48 <= k - s.token_start <= 192 + 48]
        assert (37 + s.token_end) % 32 == min((37 + k) % 32 for k in window)


def test_one_huge_sentence_is_cut_on_block_boundaries(tokenizer) -> None:
    text = " ".join(["word"] * 900)  # no sentence end at all
    _encoded, segments = _segment(tokenizer, text, target=128, cap=160, block=32, prefix=5)
    assert all(s.num_tokens <= 160 for s in segments)
    assert all((5 + s.token_end) % 32 == 0 for s in segments[:-1])


def test_short_document_is_one_segment(tokenizer) -> None:
    encoded, segments = _segment(tokenizer, "Only one sentence here.", target=64, cap=96)
    assert len(segments) == 1 and segments[0].num_tokens == len(encoded.ids)


def test_a_document_of_exactly_the_cap_is_one_segment(tokenizer) -> None:
    for text in ("Hi", " ".join(["word"] * 50)):
        n = len(tokenizer.encode_user_text(text).ids)
        _encoded, segments = _segment(tokenizer, text, target=max(n // 2, 1), cap=n)
        assert [(s.token_start, s.token_end) for s in segments] == [(0, n)]


def test_the_smallest_target_is_one_token(tokenizer) -> None:
    text = "One. Two. Three."
    encoded, segments = _segment(tokenizer, text, target=1, cap=1)
    assert len(segments) == len(encoded.ids)


@pytest.mark.parametrize(
    ("text", "target", "cap", "message"),
    [
        ("Some text.", 0, 10, "need 0 < target_tokens <= max_tokens"),
        ("Some text.", 11, 10, "need 0 < target_tokens <= max_tokens"),
        ("", 8, 10, "the document has no tokens"),
    ],
)
def test_impossible_requests_are_refused(tokenizer, text, target, cap, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _segment(tokenizer, text, target, cap)


@pytest.mark.parametrize(
    ("text", "count", "leading"),
    [
        ("The code is 4417. The fish", 1, "The code is 4417."),
        ("The code is 4417.", 1, None),  # the next sentence has not begun: it may go on
        ("The code is 4417. ", 1, None),
        ("Mr. Smith has code 4417. He", 1, "Mr. Smith has code 4417."),  # not at "Mr."
        ("The port employs 1.5 thousand. It", 1, "The port employs 1.5 thousand."),
        ("One. Two. Three", 2, "One. Two."),
        ("One. Two", 2, None),
    ],
)
def test_leading_sentences_end_where_the_next_sentence_has_begun(
    text: str, count: int, leading: str | None
) -> None:
    assert leading_sentences(text, count) == leading
