"""KV admission control: FIFO, bounded waits, clear refusals."""

from __future__ import annotations

import asyncio

import pytest

from wim_service.engine.admission import KVAdmission
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
