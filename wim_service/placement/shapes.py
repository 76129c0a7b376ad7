"""Job shapes: every kind of job as placement sees it (`Work`), in tokens and KV blocks, built
here once for the live router and replicas (`serving/replica/work.py` turns a request's options
into these numbers) and for `wim sim` (`sim/jobs.py`, from a trace row), so that a job is the
same shape wherever it is placed, booked or simulated.
"""

from __future__ import annotations

from wim_service.placement.state import Work


def document_read(
    document: str, document_tokens: int, document_blocks: int, *, restorable: bool = False
) -> Work:
    """A document session's read of its document: its first (`POST /documents`), or a
    rebuild or a copy of a document read before (`restorable`: its KV may be restored)."""
    return Work(
        prompt_tokens=document_tokens,
        answer_tokens=0,
        document=document,
        document_tokens=document_tokens,
        document_blocks=document_blocks,
        restorable=restorable,
    )


def document_query(
    document: str,
    document_tokens: int,
    document_blocks: int,
    *,
    query_tokens: int,
    answer_tokens: int,
    margins: int,
    margin_tokens: int,
) -> Work:
    """A query on a document session: `margins` margins of up to `margin_tokens` tokens, then
    its answer. It reserves nothing of its own: a copy's `document_blocks` hold one query (the
    queries on a copy take turns in them). A copy it opens restores its document, read before."""
    return Work(
        prompt_tokens=document_tokens + query_tokens,
        answer_tokens=answer_tokens,
        document=document,
        document_tokens=document_tokens,
        document_blocks=document_blocks,
        margins=margins,
        margin_tokens=margin_tokens,
        restorable=True,
    )


def one_shot(
    context_tokens: int,
    kv_blocks: int,
    *,
    query_tokens: int,
    answer_tokens: int,
    margins: int,
    margin_tokens: int,
) -> Work:
    """A one-shot WiM job: its document, query, margins and answer, in `kv_blocks` of its own."""
    return Work(
        prompt_tokens=context_tokens + query_tokens,
        answer_tokens=answer_tokens,
        kv_blocks=kv_blocks,
        margins=margins,
        margin_tokens=margin_tokens,
    )


def plain(
    prompt_tokens: int,
    answer_tokens: int,
    kv_blocks: int,
    *,
    prefix: tuple[int, ...] = (),
    block_tokens: int = 16,
) -> Work:
    """A plain request, which takes no session slot; `prefix` the hashes of its prompt's full
    blocks of `block_tokens`."""
    return Work(
        prompt_tokens=prompt_tokens,
        answer_tokens=answer_tokens,
        kv_blocks=kv_blocks,
        prefix=prefix,
        prefix_block_tokens=block_tokens,
        takes_session=False,
    )
