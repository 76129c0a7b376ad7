"""Cut a tokenized document into segments at sentence ends.

The document is tokenized once; segments are slices of that one token list, so concatenating
them gives the whole-document tokenization exactly (segment boundaries never re-tokenize).
Cut points are token boundaries that coincide with a sentence end (nltk punkt, or a blank
line). Among the sentence ends near the target size we prefer the one whose absolute position
is closest above a KV-block multiple: a margin request recomputes the context tokens past the
last full block it shares with the document's KV, so a block-aligned end costs nothing.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from wim_service.wim.tokenizer import EncodedText

if TYPE_CHECKING:
    from nltk.tokenize.punkt import PunktTokenizer

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class Segment:
    """One segment: a slice of the document's tokens and the characters they came from."""

    index: int
    token_start: int
    token_end: int
    char_start: int
    char_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@lru_cache(maxsize=1)
def _punkt() -> PunktTokenizer:
    from nltk.tokenize.punkt import PunktTokenizer

    from wim_service.assets.punkt import install_punkt

    install_punkt()
    return PunktTokenizer("english")


def sentence_ends(text: str) -> list[int]:
    """Character offsets just past each sentence (punkt) and each paragraph (blank line)."""
    ends = {end for _, end in _punkt().span_tokenize(text)}
    ends.update(match.start() for match in _PARAGRAPH_BREAK.finditer(text))
    return sorted(e for e in ends if 0 < e < len(text))


def leading_sentences(text: str, count: int) -> str | None:
    """`text` up to the end of its `count`-th sentence, once the next sentence has begun (so
    that punkt sees the word after a full stop: "Mr. Smith" is one sentence); None before."""
    ends = [end for end in sentence_ends(text) if text[end:].strip()]
    return text[: ends[count - 1]].rstrip() if len(ends) >= count else None


def _clean(encoded: EncodedText, k: int) -> bool:
    """True if a cut before token k splits no character (byte-level BPE splits some)."""
    return 0 < k < len(encoded.offsets) and encoded.offsets[k - 1][1] <= encoded.offsets[k][0]


def _token_boundaries(encoded: EncodedText, char_ends: list[int]) -> dict[int, int]:
    """Map each usable sentence end to a token boundary: {token index: char offset}.

    A sentence end is usable when a token starts at or after it and the previous token ends
    at or before that token's start (no token straddles the cut, e.g. a split multi-byte char).
    """
    starts = [start for start, _ in encoded.offsets]
    boundaries: dict[int, int] = {}
    for end in char_ends:
        k = bisect.bisect_left(starts, end)
        if _clean(encoded, k):
            boundaries.setdefault(k, starts[k])
    return boundaries


def segment_document(
    text: str,
    encoded: EncodedText,
    *,
    target_tokens: int,
    max_tokens: int,
    block_size: int,
    prefix_tokens: int,
) -> list[Segment]:
    """Segments of about `target_tokens` (never above `max_tokens`) ending on sentence ends.

    `prefix_tokens` is how many prompt tokens precede the document, so block alignment is
    judged on absolute positions in the engine's KV.
    """
    if not 0 < target_tokens <= max_tokens:
        raise ValueError("need 0 < target_tokens <= max_tokens")
    n = len(encoded.ids)
    if n == 0:
        raise ValueError("the document has no tokens")
    boundaries = _token_boundaries(encoded, sentence_ends(text))
    cuts = sorted(boundaries)
    slack = max(target_tokens // 4, 1)

    def tail(k: int) -> int:
        return (prefix_tokens + k) % block_size

    segments: list[Segment] = []
    cur, char_cur = 0, 0
    while n - cur > max_tokens:
        lo = bisect.bisect_right(cuts, cur)
        hi = bisect.bisect_right(cuts, cur + max_tokens)
        reachable = cuts[lo:hi]
        window = [k for k in reachable if target_tokens - slack <= k - cur <= target_tokens + slack]
        if window:
            k = min(window, key=lambda k: (tail(k), abs(k - cur - target_tokens)))
        elif reachable:
            k = min(reachable, key=lambda k: abs(k - cur - target_tokens))
        else:
            # No sentence end within reach (one huge sentence): cut at a clean token boundary
            # (never inside a multi-token character), on a block multiple where one exists.
            k = min(
                (j for j in range(cur + 1, cur + max_tokens + 1) if _clean(encoded, j)),
                key=lambda j: (tail(j) != 0, abs(j - cur - target_tokens)),
                default=cur + max_tokens,
            )
        char_end = boundaries.get(k, encoded.offsets[k][0])
        segments.append(Segment(len(segments), cur, k, char_cur, char_end))
        cur, char_cur = k, char_end
    segments.append(Segment(len(segments), cur, n, char_cur, len(text)))
    return segments
