"""`wim sim --generate`: a synthetic WiM document trace, the same for the same seed.

Sessions arrive as a Poisson process; each picks a document by Zipf popularity (document k of
n with weight 1 / k**exponent, so `doc-0000` is the hottest) and sends its queries one after
another, a think time apart. Each query is a WiM query with probability `wim_fraction`, else
a plain long-context request over the same document. With `duration_s`, queries arriving
after it are left out (so a live replay of the trace keeps to a time budget).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from wim_service.sim.settings import check_bounds
from wim_service.sim.traces import (
    DOCUMENT_BLOCK_TOKENS,
    MAX_ARRIVAL_S,
    MAX_REQUESTS,
    MAX_TOKENS,
    MAX_TRACE_BLOCKS,
    margins_bound,
)


@dataclass(frozen=True)
class GeneratorOptions:
    requests: int = 1000
    rate: float = 1.0  # queries per second over the whole trace
    documents: int = 50
    zipf_exponent: float = 1.1
    queries_per_session: int = 4
    think_s: float = 20.0  # mean seconds between a session's queries
    document_tokens: tuple[int, int] = (2000, 8000)
    query_tokens: int = 64
    answer_tokens: int = 128
    wim_fraction: float = 0.7
    duration_s: float | None = None  # leave out the queries arriving later
    margins: int | None = None  # margins each WiM query writes; None: one per segment
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first option out of its bounds: those of the trace it
        writes (`traces`), and finite times and rates."""
        low, high = self.document_tokens
        check_bounds(
            [
                ("requests", self.requests, 1, MAX_REQUESTS),
                ("rate", self.rate, 0.001, 1e6),
                ("documents", self.documents, 1, MAX_REQUESTS),
                ("zipf_exponent", self.zipf_exponent, 0, 10),  # k**exponent stays finite
                ("queries_per_session", self.queries_per_session, 1, MAX_REQUESTS),
                ("think_s", self.think_s, 0, 86_400),
                ("document_tokens LOW", low, 1, MAX_TOKENS),
                ("document_tokens HIGH", high, low, MAX_TOKENS),
                ("query_tokens", self.query_tokens, 1, MAX_TOKENS),
                ("answer_tokens", self.answer_tokens, 1, MAX_TOKENS),
                ("wim_fraction", self.wim_fraction, 0, 1),
                ("duration_s", self.duration_s, 0.001, MAX_ARRIVAL_S),
                ("margins", self.margins, 0, margins_bound(low, None)),
                ("seed", self.seed, 0, 2**63 - 1),
            ]
        )


def zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (k**exponent) for k in range(1, n + 1)]


def _sessions(options: GeneratorOptions, rng: random.Random) -> Iterator[list[dict[str, Any]]]:
    """Sessions in order of their start, each its list of rows (unsorted across sessions)."""
    weights = list(accumulate(zipf_weights(options.documents, options.zipf_exponent)))
    low, high = options.document_tokens
    # Drawn up front so that a document's length does not depend on when it is first picked.
    lengths = [rng.randint(low, high) for _ in range(options.documents)]
    session_rate = options.rate / options.queries_per_session
    start = 0.0
    for number in range(math.ceil(options.requests / options.queries_per_session)):
        start += rng.expovariate(session_rate)
        document = rng.choices(range(options.documents), cum_weights=weights)[0]
        at, rows = start, []
        for _ in range(options.queries_per_session):
            row = {
                "timestamp_s": round(at, 3),
                "session_id": f"s-{number:05d}",
                "document_id": f"doc-{document:04d}",
                "document_tokens": lengths[document],
                "query_tokens": options.query_tokens,
                "answer_tokens": options.answer_tokens,
                "wim": rng.random() < options.wim_fraction,
            }
            if row["wim"] and options.margins is not None:
                row["margins"] = options.margins
            rows.append(row)
            at += rng.expovariate(1 / options.think_s) if options.think_s else 0.0
        yield rows


def generate(options: GeneratorOptions) -> list[dict[str, Any]]:
    """The trace's rows in timestamp order: `options.requests` of them (fewer when some
    arrive after `options.duration_s`)."""
    options.check()
    rng = random.Random(options.seed)
    end = math.inf if options.duration_s is None else options.duration_s
    rows = [row for session in _sessions(options, rng) for row in session]
    rows = [row for row in rows if row["timestamp_s"] <= end]
    rows.sort(key=lambda row: row["timestamp_s"])  # stable: a session's ties keep its order
    rows = rows[: options.requests]
    check_readable(rows)
    return rows


def check_readable(rows: list[dict[str, Any]]) -> None:
    """Raise ValueError if `read_trace` would refuse the trace of `rows` as a whole: its
    options are each within bounds, but not every combination of them is."""
    if rows and rows[-1]["timestamp_s"] > MAX_ARRIVAL_S:
        raise ValueError(f"the trace would last beyond {MAX_ARRIVAL_S:g} s: raise rate")
    blocks = sum(
        margins_bound(row["document_tokens"], row.get("margins"))
        if row["wim"]
        else row["document_tokens"] // DOCUMENT_BLOCK_TOKENS
        for row in rows
    )
    if blocks > MAX_TRACE_BLOCKS:
        raise ValueError(
            f"the trace would hold {blocks:,} prefix hashes and margins, more than "
            f"{MAX_TRACE_BLOCKS:,}: fewer requests or shorter documents"
        )


def write_trace(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
