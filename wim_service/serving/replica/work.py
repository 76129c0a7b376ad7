"""Jobs as placement sees them (`placement.state.Work`), built from what the router and the
replicas know of a job (its options, its text's estimated tokens) by the shapes `wim sim` builds
its jobs with too (`placement/shapes.py`): the same shape on every side, so that the router's
booking between two load reports, the replica's own backlog and the simulator agree.
"""

from __future__ import annotations

import math

from wim_service.placement import shapes
from wim_service.placement.state import Work
from wim_service.wim.options import WiMOptions

# About how many characters of English text one token of the default model holds: a query's
# (and, on a replica, a one-shot job's document's) tokens are estimated, not counted, since
# counting would tokenize on the event loop for a cost estimate.
CHARS_PER_TOKEN = 4


def estimated_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def session_work(
    document_id: str,
    context_tokens: int,
    kv_blocks: int,
    options: WiMOptions,
    *,
    query: str | None = None,
    segments: int = 0,
    restorable: bool = False,
) -> Work:
    """A document session's job: its read (`query` None; a first read, or `restorable`: a
    rebuild or a copy of a document read before), or a query on it."""
    if query is None:
        return shapes.document_read(document_id, context_tokens, kv_blocks, restorable=restorable)
    return shapes.document_query(
        document_id,
        context_tokens,
        kv_blocks,
        query_tokens=estimated_tokens(query),
        answer_tokens=options.answer_max_tokens,
        margins=segments,
        margin_tokens=options.margin_max_tokens,
    )


def one_shot_work(
    context_tokens: int, segments: int, kv_blocks: int, options: WiMOptions, query: str
) -> Work:
    """A one-shot WiM job: its document, query, margins and answer."""
    return shapes.one_shot(
        context_tokens,
        kv_blocks,
        query_tokens=estimated_tokens(query),
        answer_tokens=options.answer_max_tokens,
        margins=segments,
        margin_tokens=options.margin_max_tokens,
    )


def plain_work(
    prompt_tokens: int,
    max_tokens: int,
    kv_blocks: int,
    *,
    prefix: tuple[int, ...] = (),
    block_tokens: int = 16,
) -> Work:
    """A plain request; `prefix` the hashes of its prompt's full blocks of `block_tokens`."""
    return shapes.plain(
        prompt_tokens, max_tokens, kv_blocks, prefix=prefix, block_tokens=block_tokens
    )
