"""KV admission control: FIFO, bounded waits, clear refusals."""

from __future__ import annotations

import asyncio
import time

import pytest

from wim_service.engine.admission import AdmissionLoad, KVAdmission
from wim_service.wim.errors import ErrorCode, WiMError


async def test_waits_in_arrival_order_then_admits() -> None:
    gate = KVAdmission(capacity_blocks=100, max_sessions=10, timeout_s=5)
    await gate.acquire(60)
    order: list[str] = []

    async def job(name: str, blocks: int) -> None:
        await gate.acquire(blocks)
        order.append(name)

    big = asyncio.create_task(job("big", 70))
    await asyncio.sleep(0.01)
    small = asyncio.create_task(job("small", 10))  # would fit now, but must not overtake
    await asyncio.sleep(0.05)
    assert order == [] and gate.load().waiting == 2
    gate.release(60)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert gate.load().reserved_blocks == 80 and gate.load().sessions == 2


async def test_refuses_when_full_after_timeout() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=1, timeout_s=0.1)
    await gate.acquire(1)
    with pytest.raises(WiMError) as info:
        await gate.acquire(1)  # the session limit, not blocks
    assert info.value.code is ErrorCode.OVERLOADED and info.value.retry_after_s
    assert gate.load().waiting == 0


async def test_refuses_what_can_never_fit() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=4, timeout_s=10)
    with pytest.raises(WiMError) as info:
        await gate.acquire(11)
    assert info.value.code is ErrorCode.TOO_LONG


async def test_a_timed_out_head_unblocks_the_queue() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=4, timeout_s=0.2)
    await gate.acquire(8)
    head = asyncio.create_task(gate.acquire(5))  # cannot fit until release
    await asyncio.sleep(0.01)
    gate.timeout_s = 5
    second = asyncio.create_task(gate.acquire(2))  # fits, but waits behind the head
    with pytest.raises(WiMError):
        await head
    await asyncio.wait_for(second, 1)
    assert gate.load().reserved_blocks == 10


async def test_fills_to_capacity_and_reports_its_load() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=4, timeout_s=5)
    await gate.acquire(10)  # exactly the capacity fits
    assert gate.load() == AdmissionLoad(
        sessions=1, reserved_blocks=10, capacity_blocks=10, waiting=0
    )
    gate.release(10)
    assert gate.load() == AdmissionLoad(0, 0, 10, 0)
    with pytest.raises(WiMError) as info:
        await gate.acquire(11)
    assert info.value.message == (
        "the job needs up to 11 KV blocks but this engine holds 10; send a shorter document"
    )


async def test_a_waiter_is_admitted_when_room_comes_within_its_timeout() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=4, timeout_s=0.5)
    await gate.acquire(8)
    waiter = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    gate.release(8)
    await asyncio.wait_for(waiter, 1)
    assert gate.load().reserved_blocks == 5


async def test_refusal_comes_after_the_timeout_and_says_why() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=4, timeout_s=0.2)
    await gate.acquire(8)
    started = time.monotonic()
    waiter = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0.05)
    gate.timeout_s = 3  # the deadline stays; Retry-After follows the current setting
    with pytest.raises(WiMError) as info:
        await waiter
    assert time.monotonic() - started >= 0.2
    assert info.value.retry_after_s == 1.5
    assert (
        str(info.value)
        == info.value.message
        == ("no KV capacity for this document now (1 sessions hold 8/10 blocks); retry later")
    )
    # Not below one second, however short the timeout.
    gate.timeout_s = 0.05
    with pytest.raises(WiMError) as info:
        await gate.acquire(5)
    assert info.value.retry_after_s == 1.0


async def test_a_running_session_reserves_more_blocks_beyond_the_session_limit() -> None:
    gate = KVAdmission(capacity_blocks=10, max_sessions=1, timeout_s=0.1)
    await gate.acquire(4)
    await gate.acquire(3, session=False)  # a query's extra room: no new session
    assert gate.load() == AdmissionLoad(1, 7, 10, 0)
    with pytest.raises(WiMError):
        await gate.acquire(4, session=False)  # 11 blocks: waits, then is refused
    gate.release(3, session=False)
    assert gate.load() == AdmissionLoad(1, 4, 10, 0)
    gate.release(4)
    assert gate.load() == AdmissionLoad(0, 0, 10, 0)


async def test_a_waiter_cancelled_as_its_turn_comes_ends_cancelled_holding_nothing() -> None:
    """Room comes and the waiting job's client leaves in the same turn of the loop. Python
    3.11's `asyncio.wait_for` lost such a cancel: the job went on for nobody, holding a
    session slot and its blocks."""
    gate = KVAdmission(capacity_blocks=10, max_sessions=1, timeout_s=5)
    await gate.acquire(1)
    waiter = asyncio.create_task(gate.acquire(4))
    await asyncio.sleep(0.01)
    gate.release(1)
    await asyncio.sleep(0)  # the room reaches the waiter; its cancel comes next
    cancelled_while_waiting = waiter.cancel()
    await asyncio.wait({waiter}, timeout=1)
    assert waiter.cancelled() is cancelled_while_waiting
    assert gate.load().sessions == (0 if cancelled_while_waiting else 1)


async def test_a_side_by_side_reservation_leaves_the_kept_blocks_to_new_sessions() -> None:
    # `acquire_now` (a session's query beside the one in turn) leaves `keep_free_blocks` free;
    # a new session (`acquire`) may take them.
    gate = KVAdmission(capacity_blocks=100, max_sessions=4, timeout_s=0.1, keep_free_blocks=10)
    assert gate.acquire_now(90) and not gate.acquire_now(1)
    await gate.acquire(10)
    assert gate.load().reserved_blocks == 100 and gate.load().sessions == 1
    gate.release(10)
    gate.release(90, session=False)
    assert not gate.acquire_now(91) and gate.acquire_now(90)
