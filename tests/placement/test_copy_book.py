"""The copies of documents a router keeps (`placement/copies.py`): which are idle, which spare,
which a sweep closes, and what a store's listing changes; and the shape of a one-shot job
(`placement/shapes.py`)."""

from __future__ import annotations

from wim_service.placement.copies import CopyBook
from wim_service.placement.shapes import one_shot
from wim_service.placement.state import Work


def test_a_copy_is_idle_once_no_query_used_it_for_the_idle_time() -> None:
    book = CopyBook()
    book.opened("doc", "r1", now=10.0)
    assert ("doc", "r1") in book and len(book) == 1
    assert book.idle(now=19.0, idle_s=10.0) == []
    assert book.idle(now=20.0, idle_s=10.0) == [("doc", "r1")]  # exactly the idle time


def test_a_copy_is_never_idle_while_queries_run_and_ends_used_by_the_last() -> None:
    book = CopyBook()
    book.opened("doc", "r1", now=0.0)
    book.begin("doc", "r1")
    book.begin("doc", "r1")
    assert book.running("doc", "r1") == 2
    assert book.idle(now=100.0, idle_s=0.0) == []
    book.end("doc", "r1", now=50.0)
    assert book.running("doc", "r1") == 1
    assert book.idle(now=100.0, idle_s=0.0) == []
    book.end("doc", "r1", now=60.0)
    assert book.running("doc", "r1") == 0
    assert book.idle(now=69.0, idle_s=10.0) == []  # used at 60 by the query that ended
    assert book.idle(now=70.0, idle_s=10.0) == [("doc", "r1")]


def test_a_query_on_a_primary_is_counted_but_no_copy_is_made_of_it() -> None:
    book = CopyBook()
    book.begin("doc", "primary")
    book.end("doc", "primary", now=5.0)
    assert ("doc", "primary") not in book and len(book) == 0
    assert book.running("doc", "primary") == 0


def test_spare_copies_come_in_the_order_they_were_opened() -> None:
    book = CopyBook()
    book.opened("b", "r2", now=1.0)
    book.opened("a", "r1", now=2.0)
    book.opened("c", "r1", now=3.0)
    book.begin("c", "r1")
    assert book.idle(now=3.0, idle_s=0.0) == [("b", "r2"), ("a", "r1")]


def test_a_sweep_closes_the_spare_copies_and_only_those_of_the_tenant_asked() -> None:
    book = CopyBook()
    book.opened("a", "r1", now=1.0)
    book.opened("b", "r2", now=2.0)
    book.opened("c", "r3", now=3.0)
    book.begin("c", "r3")  # in use: never spare
    assert book.spare(now=3.0) == [("a", "r1"), ("b", "r2")]  # a reclaim: every spare one
    assert book.spare(now=11.0, idle_s=10.0) == [("a", "r1")]  # retiring the idle
    tenants = {"a": "t1", "b": "t2", "c": "t2"}
    assert book.spare(now=3.0, tenants=tenants, only="t2") == [("b", "r2")]
    assert book.spare(now=3.0, tenants=tenants, only="t3") == []
    assert book.spare(now=3.0, only="t1") == []  # a document of no known tenant: not its


def test_a_sweep_never_closes_a_documents_last_holder() -> None:
    """Where the holders are counted (`wim sim`, whose primaries close when idle), each
    document keeps one: its primary if it still holds one, else its copy opened last."""
    book = CopyBook()
    book.opened("a", "r1", now=1.0)
    book.opened("a", "r2", now=2.0)
    book.opened("b", "r1", now=3.0)
    book.opened("a", "r3", now=4.0)
    # "a": its primary and three copies; "b": its primary gone, one copy left.
    assert book.spare(now=5.0, holders={"a": 4, "b": 1}) == [("a", "r1"), ("a", "r2"), ("a", "r3")]
    # "a"'s primary went idle and closed too: two of its three copies close, the last stays.
    assert book.spare(now=5.0, holders={"a": 3, "b": 1}) == [("a", "r1"), ("a", "r2")]


def test_a_listing_adds_other_routers_copies_and_forgets_closed_ones() -> None:
    book = CopyBook()
    book.opened("a", "r1", now=1.0)
    book.opened("b", "r1", now=2.0)
    book.listed([("a", "r1"), ("c", "r2")], now=10.0)
    assert ("b", "r1") not in book and ("c", "r2") in book and len(book) == 2
    # "a" keeps when it was last used; "c", new here, is idle from the listing on.
    assert book.idle(now=11.0, idle_s=5.0) == [("a", "r1")]
    assert book.idle(now=15.0, idle_s=5.0) == [("a", "r1"), ("c", "r2")]
    book.closed("a", "r1")
    book.closed("a", "r1")  # closed twice (two routers): no error
    assert ("a", "r1") not in book and len(book) == 1


def test_a_one_shot_job_reserves_its_own_blocks_and_holds_no_document() -> None:
    work = one_shot(3000, 120, query_tokens=40, answer_tokens=16, margins=3, margin_tokens=5)
    assert work == Work(
        prompt_tokens=3040, answer_tokens=16, kv_blocks=120, margins=3, margin_tokens=5
    )
    assert work.document is None and work.takes_session and not work.restorable
