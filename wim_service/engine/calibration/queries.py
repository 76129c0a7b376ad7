"""WiM query samples for calibration: real queries on a document session, and what they
take beyond the profile's prefill and decode costs (`EngineProfile.query_extra_tokens`,
fitted by `fit.fit_query_extra`).

A document of filler sentences holds an access code for each of three places, each in a
segment of its own (`query_document`); it is read into a document session, and one query per
place is asked, alone, timed from its submission to its answer's first text (what a client
sees). Each writes one margin: the other segments share too few of its words
(`skip_unmatched_segments`), as for a needle question. What the queries take beyond the
profile's prefill and decode costs (`EngineProfile.lone_query_seconds`) is mostly the answers
WiM starts beside its last margin (`answer_early`), one per guess at the notes, whose prefills
attend to the whole document and pause the margin's decode. It is fitted as tokens prefilled
after the document (`query_extra_tokens`), so it grows with the document as they do: a fixed
number of seconds missed queries on short and long documents by nearly twice as much
(docs/routing.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from wim_service.placement.profile import QuerySample
from wim_service.wim.options import WiMOptions

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend
    from wim_service.wim.orchestrator import WiMSession
    from wim_service.wim.tokenizer import Tokenizer

# One query per place, each place's code in a segment of its own.
QUERY_PLACES = ("north gate", "river mill", "old tower")
QUERY_CODES = ("4821", "3907", "6154")
# Margins and answers as `loadtest/compare_sim.py` replays them (a margin's one sentence).
QUERY_MARGIN_TOKENS = 16
# Filler that shares no content word with the queries, so no margin is written for it.
_FILLER = "Crate {n} of the morning shipment was stacked beside the {colour} wall by noon."
_COLOURS = ("red", "blue", "green", "white", "grey")


def query_document(tokenizer: Tokenizer, tokens: int) -> str:
    """About `tokens` tokens of filler with each place's code at 1/6, 3/6 and 5/6 of it."""
    sentence_tokens = len(tokenizer.encode_user_text(_FILLER.format(n=10, colour="red")).ids)
    sentences = [
        _FILLER.format(n=n, colour=_COLOURS[n % len(_COLOURS)])
        for n in range(max(len(QUERY_PLACES), tokens // sentence_tokens))
    ]
    for i, (place, code) in reversed(list(enumerate(zip(QUERY_PLACES, QUERY_CODES, strict=True)))):
        depth = len(sentences) * (2 * i + 1) // (2 * len(QUERY_PLACES))
        sentences.insert(depth, f"The access code for the {place} is {code}.")
    return " ".join(sentences)


async def time_query(session: WiMSession, query: str, options: WiMOptions) -> QuerySample:
    """One WiM query on a read document: seconds to its answer's first text, its shape."""
    started = time.perf_counter()
    first: float | None = None
    margins, margin_tokens = 0, 0
    async for event in session.query(query, options):
        if event.type == "answer" and event.text and first is None:
            first = time.perf_counter() - started
        elif event.type == "margin" and not event.skipped:
            margins += 1
        elif event.type == "done":
            first = first if first is not None else time.perf_counter() - started
            margin_tokens = event.usage.margin_tokens
        elif event.type == "error":
            raise RuntimeError(f"a calibration query failed: {event.message}")
    assert first is not None
    return QuerySample(
        document=len(session.plan.encoded.ids),
        query=len(session.builder.tokenizer.encode_user_text(query).ids),
        margins=margins,
        margin_tokens=margin_tokens / margins if margins else 0,
        seconds=first,
    )


async def measure_queries(
    backend: VLLMBackend, documents: Sequence[int], queries_per_document: int
) -> list[QuerySample]:
    """WiM query samples: a `query_document` of each size in `documents` read into a
    document session, then `queries_per_document` queries asked of it one at a time."""
    from wim_service.wim.orchestrator import open_document

    options = WiMOptions(
        margin_max_tokens=QUERY_MARGIN_TOKENS, answer_max_tokens=QUERY_MARGIN_TOKENS
    )
    samples = []
    for tokens in documents:
        text = query_document(backend.tokenizer, tokens)
        session = await open_document(backend, backend.tokenizer, text, options)
        try:
            for place in QUERY_PLACES[:queries_per_document]:
                query = f"What is the access code for the {place}?"
                samples.append(await time_query(session, query, options))
        finally:
            await session.close()
    return samples
