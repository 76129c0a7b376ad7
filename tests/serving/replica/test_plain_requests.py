"""Plain engine requests (the OpenAI API's short prompts) on the real vLLM engine:
`VLLMBackend.stream_complete` and the replica's `plain_events`."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import pytest

from wim_service.serving.openai.prompts import Turn, chat_prompt_ids
from wim_service.serving.replica.plain import PlainParams, plain_blocks, plain_events
from wim_service.serving.tenants import Tenant, TenantLimits
from wim_service.wim.errors import ErrorCode, WiMError

pytestmark = pytest.mark.engine

DOOR = "The lighthouse keeper paints the door green every spring. " * 4


def door_prompt(engine) -> list[int]:
    return chat_prompt_ids(
        engine.tokenizer, [Turn("user", DOOR + "\nWhat colour is the door? Answer in a sentence.")]
    )


async def test_stream_complete_streams_what_complete_returns(engine) -> None:
    prompt = door_prompt(engine)
    whole = await engine.complete(prompt, max_tokens=24)
    chunks = [c async for c in engine.stream_complete(prompt, max_tokens=24)]
    assert len(chunks) > 1  # deltas, not one final output
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids  # greedy: the same
    assert "".join(c.text for c in chunks).strip() == whole.text
    assert chunks[0].cost is not None and all(c.cost is None for c in chunks[1:])
    assert chunks[-1].finish_reason in ("stop", "length")


async def test_stop_strings_cut_the_text(engine) -> None:
    prompt = door_prompt(engine)
    free = "".join([c.text async for c in engine.stream_complete(prompt, max_tokens=24)])
    word = next(w for w in free.split() if len(w) > 3)
    cut = [c async for c in engine.stream_complete(prompt, max_tokens=24, stop=[word])]
    text = "".join(c.text for c in cut)
    assert word not in text and free.startswith(text)
    assert cut[-1].finish_reason == "stop"


async def test_a_reserving_request_holds_its_blocks_until_it_ends(engine) -> None:
    prompt = door_prompt(engine)
    before = engine.load().reserved_blocks
    free = (await engine.kv_stats()).free_blocks
    needed = plain_blocks(len(prompt), params(24, "tenant:a"), engine.limits.block_size)
    stream = engine.stream_complete(prompt, max_tokens=24, reserve=True)
    await anext(stream)
    assert engine.load().reserved_blocks == before + needed
    assert (await engine.kv_stats()).free_blocks < free
    await stream.aclose()  # the caller leaves early: the request is aborted
    assert engine.load().reserved_blocks == before
    for _ in range(100):  # the abort reaches the engine core within a step or two
        if (await engine.kv_stats()).free_blocks == free:
            break
        await asyncio.sleep(0.05)
    assert (await engine.kv_stats()).free_blocks == free


async def test_a_request_past_the_window_is_refused(engine) -> None:
    with pytest.raises(WiMError) as refused:
        await anext(engine.stream_complete([1] * 4000, max_tokens=200))
    assert refused.value.code is ErrorCode.TOO_LONG


def params(max_tokens: int, cache_salt: str) -> PlainParams:
    return PlainParams(max_tokens=max_tokens, cache_salt=cache_salt)


def two_tenants() -> tuple[str, str]:
    a, b = (f"tenant:{name}-{secrets.token_hex(4)}" for name in "ab")  # new to the engine
    return a, b


def two_users_of_one_tenant() -> tuple[str, str]:
    """Two end users (OpenAI's `user`) of a tenant new to the engine."""
    tenant = Tenant(f"tenant-{secrets.token_hex(4)}", TenantLimits())
    return tenant.salt_for("alice"), tenant.salt_for("bob")


@pytest.mark.parametrize("salts", [two_tenants, two_users_of_one_tenant])
async def test_another_tenant_or_user_gets_no_cache_hit_on_the_same_prompt(
    engine, salts: Callable[[], tuple[str, str]]
) -> None:
    """The prefix-cache side channel (vLLM's CVE-2025-46570, through our `cached_tokens`):
    a prompt tenant A (or end user A of a tenant) sent is cached for A alone."""
    a, b = salts()
    prompt = door_prompt(engine)
    first = [e async for e in plain_events(engine, prompt, params(4, a))]
    assert first[-1].usage.prompt_tokens_cached == 0
    other = [e async for e in plain_events(engine, prompt, params(4, b))]
    assert other[-1].usage.prompt_tokens_cached == 0
    same = [e async for e in plain_events(engine, prompt, params(4, a))]
    assert same[-1].usage.prompt_tokens_cached >= engine.limits.block_size


async def test_plain_events_answer_with_usage(engine) -> None:
    prompt = door_prompt(engine)
    events = [e async for e in plain_events(engine, prompt, params(24, "tenant:a"))]
    *answers, done = events
    assert {e.type for e in answers} == {"answer"} and done.type == "done"
    assert "".join(e.text for e in answers) == done.answer and "green" in done.answer.lower()
    usage = done.usage
    assert usage.prompt_tokens_submitted == len(prompt) and 0 < usage.answer_tokens <= 24
    assert usage.prompt_tokens_cached + usage.prompt_tokens_computed == len(prompt)
    assert 0 < done.timings.answer_ttft_s <= done.timings.total_s
    again = [e async for e in plain_events(engine, prompt, params(24, "tenant:a"))]
    assert again[-1].usage.prompt_tokens_cached > 0  # the same prompt: its blocks are cached
    refused = [e async for e in plain_events(engine, [1] * 4090, params(64, "tenant:a"))]
    assert [e.type for e in refused] == ["error"] and refused[0].code == "too_long"
