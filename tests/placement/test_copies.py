"""The book of copies (`placement/copies.py`) the router and `wim sim` both keep."""

from __future__ import annotations

from wim_service.placement.copies import CopyBook


def test_a_copy_is_idle_once_no_query_runs_on_it_for_the_idle_time() -> None:
    book = CopyBook()
    book.opened("doc", "b", now=10.0)
    assert book.idle(now=15.0, idle_s=10.0) == []  # read 5 s ago
    assert book.idle(now=20.0, idle_s=10.0) == [("doc", "b")]
    book.begin("doc", "b")
    book.begin("doc", "b")
    assert book.running("doc", "b") == 2 and book.idle(now=100.0, idle_s=0.0) == []
    book.end("doc", "b", now=30.0)
    assert book.idle(now=100.0, idle_s=0.0) == []  # one query still runs
    book.end("doc", "b", now=40.0)
    assert book.running("doc", "b") == 0
    assert book.idle(now=45.0, idle_s=10.0) == [] and book.idle(now=50.0, idle_s=10.0)


def test_a_primary_is_never_a_copy_and_a_closed_copy_is_gone() -> None:
    book = CopyBook()
    book.begin("doc", "a")  # a query on the session's primary
    book.end("doc", "a", now=1.0)
    assert len(book) == 0 and ("doc", "a") not in book and book.idle(99.0, 0.0) == []
    book.opened("doc", "b", now=1.0)
    book.opened("doc", "c", now=2.0)
    assert book.idle(now=2.0, idle_s=0.0) == [("doc", "b"), ("doc", "c")]  # opened order
    book.closed("doc", "b")
    assert ("doc", "b") not in book and len(book) == 1


def test_a_listing_adds_other_routers_copies_as_idle_from_now_and_forgets_the_rest() -> None:
    book = CopyBook()
    book.opened("doc", "b", now=1.0)
    book.opened("old", "c", now=1.0)
    book.listed([("doc", "b"), ("new", "d")], now=50.0)
    assert ("old", "c") not in book
    # b keeps when it was last used; d, first seen now, is idle from now.
    assert book.idle(now=60.0, idle_s=20.0) == [("doc", "b")]
    assert book.idle(now=70.0, idle_s=20.0) == [("doc", "b"), ("new", "d")]
