"""Jobs as placement sees them (`placement.state.Work`), built from what the router and the
replicas know of a job: the same shape on both sides, so that the router's booking between two
load reports and the replica's own backlog agree.
"""

from __future__ import annotations

import math

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
    rebuild or a copy of a document read before), or a query on it. A query reserves nothing
    new: the session's own reservation holds one query; a copy it opens restores."""
    if query is None:
        return Work(
            prompt_tokens=context_tokens,
            answer_tokens=0,
            document=document_id,
            document_tokens=context_tokens,
            document_blocks=kv_blocks,
            restorable=restorable,
        )
    return Work(
        prompt_tokens=context_tokens + estimated_tokens(query),
        answer_tokens=options.answer_max_tokens,
        document=document_id,
        document_tokens=context_tokens,
        document_blocks=kv_blocks,
        margins=segments,
        margin_tokens=options.margin_max_tokens,
        restorable=True,
    )


def one_shot_work(
    context_tokens: int, segments: int, kv_blocks: int, options: WiMOptions, query: str
) -> Work:
    """A one-shot WiM job: its document, query, margins and answer."""
    return Work(
        prompt_tokens=context_tokens + estimated_tokens(query),
        answer_tokens=options.answer_max_tokens,
        kv_blocks=kv_blocks,
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
    return Work(
        prompt_tokens=prompt_tokens,
        answer_tokens=max_tokens,
        kv_blocks=kv_blocks,
        prefix=prefix,
        prefix_block_tokens=block_tokens,
        takes_session=False,
    )
