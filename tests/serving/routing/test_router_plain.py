"""The dispatcher's plain requests (`Dispatcher.plain`, what the OpenAI API sends short prompts
through) over scripted fake replicas: placement by KV blocks, the binding held while the request
streams, and a lost replica — no Ray, no engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fakes.fake_service import PLAIN_ANSWER, ScriptedClient, ScriptedReplica
from tests.fakes.router import counted
from wim_service.serving.errors import ServiceError
from wim_service.serving.replica.client import ReplicaLost
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import OPEN_TENANT
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import WiMEvent

SESSION = "plain-test"
# 30 prompt tokens + 2 answer tokens fill exactly two 16-token KV blocks.
PROMPT = list(range(100, 130))
PARAMS = PlainParams(max_tokens=2, cache_salt="tenant:test")
BLOCKS = 2


async def router_over(
    *replicas: ScriptedReplica, client: type = ScriptedClient, **router: Any
) -> WiMRouter:
    config = {"engine": {"block_size": 16}, "router": {"replica_wait_s": 0, **router}}
    router = WiMRouter(None, config, client=client(*replicas), http_host="127.0.0.1")
    await router.fleet.refresh_loads()
    return router


async def test_a_plain_request_streams_from_its_replica_bound_while_it_runs() -> None:
    replica = ScriptedReplica("a", capacity=BLOCKS)
    router = await router_over(replica)
    events = router.dispatcher.plain(SESSION, PROMPT, PARAMS)
    first_replica, first = await anext(events)
    # While it streams, the request holds its binding and its KV blocks on the replica.
    assert router.fleet.ledger.replica_of(SESSION) == "a"
    assert router.fleet.ledger.loads["a"].reserved_blocks == BLOCKS
    rest = [event async for _, event in events]
    assert first_replica == "a"
    assert replica.streams == [("complete", (PROMPT, PARAMS))]
    assert "".join(e.text for e in [first, *rest] if e.type == "answer") == " ".join(
        PLAIN_ANSWER.split(" ")[:2]
    )
    assert rest[-1].type == "done"
    assert router.fleet.ledger.replica_of(SESSION) is None  # unbound once it ended
    assert counted(router, "wim_session_binding_total", result="new") == 1


async def test_a_plain_request_needs_its_prompt_and_answer_blocks() -> None:
    router = await router_over(ScriptedReplica("a", capacity=BLOCKS - 1))
    with pytest.raises(ServiceError) as refused:
        await anext(router.dispatcher.plain(SESSION, PROMPT, PARAMS))
    assert refused.value.status == 429
    assert "no engine replica has room for 2 KV blocks (1 live)" in refused.value.message
    assert counted(router, "wim_session_binding_total", result="new") == 0


async def test_a_plain_request_takes_kv_but_no_session_slot() -> None:
    # The engine admits a plain request by its KV alone: a replica whose session slots are
    # all held still takes it, and the router books it no slot.
    replica = ScriptedReplica("a", capacity=BLOCKS)
    replica.max_sessions = 0
    router = await router_over(replica)
    events = router.dispatcher.plain(SESSION, PROMPT, PARAMS)
    assert (await anext(events))[0] == "a"
    load = router.fleet.ledger.loads["a"]
    assert (load.reserved_blocks, load.sessions) == (BLOCKS, 0)
    assert [event async for _, event in events][-1].type == "done"


LOST = "the engine replica running this request was lost; send the request again (incident "


async def test_a_plain_request_on_a_lost_replica_is_not_failed_over() -> None:
    lost, spare = ScriptedReplica("a", capacity=100), ScriptedReplica("b", capacity=10)
    router = await router_over(lost, spare)
    lost.dead = True  # dies after the last load poll: still placed there (most room)
    with pytest.raises(WiMError) as failed:
        async for _ in router.dispatcher.plain(SESSION, PROMPT, PARAMS):
            pass
    assert failed.value.code == ErrorCode.UNAVAILABLE and failed.value.retry_after_s == 5
    assert failed.value.message.startswith(LOST)
    assert str(failed.value.__cause__) not in failed.value.message  # logged, not sent
    assert spare.streams == []  # the client sends it again, the router does not
    assert router.fleet.ready() == ["b"]
    assert counted(router, "wim_session_failover_total", reason="replica_lost") == 1
    assert router.fleet.ledger.replica_of(SESSION) is None


class DiesMidAnswer(ScriptedClient):
    """Each replica dies after the first event it streams."""

    async def stream(
        self, replica: str, events: AsyncIterator[WiMEvent]
    ) -> AsyncIterator[WiMEvent]:
        streamed = super().stream(replica, events)
        yield await anext(streamed)
        self.replicas[replica].dead = True
        raise ReplicaLost(replica, RuntimeError("actor died mid-stream"))


async def test_a_plain_answer_cut_by_a_lost_replica_ends_with_an_error_event() -> None:
    router = await router_over(ScriptedReplica("a"), client=DiesMidAnswer)
    try:
        items = await router.start_plain(PROMPT, PARAMS, OPEN_TENANT)
        got = [item async for item in items]
    finally:
        if router._background is not None:
            router._background.cancel()
    # The first delta was already sent: the failure can only be an event of the stream.
    assert [(replica, event.type) for replica, event in got] == [("a", "answer"), ("a", "error")]
    error = got[-1][1]
    assert error.type == "error" and error.code == "unavailable" and error.retry_after_s == 5
    assert error.message.startswith(LOST) and "RuntimeError" not in error.message


# 20 full blocks of 16 tokens: a prefix worth going back for.
LONG_PROMPT = list(range(1000, 1320))


async def sent_to(router: WiMRouter, prompt: list[int], params: PlainParams) -> str:
    """Where a plain request ran, placed on freshly polled loads."""
    await router.fleet.refresh_loads()
    replicas = {replica async for replica, _ in router.dispatcher.plain(SESSION, prompt, params)}
    (replica,) = replicas
    return replica


async def test_a_repeated_long_prefix_goes_back_to_its_replica_unless_it_is_busier() -> None:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    router = await router_over(a, b, placement="expected_wait")
    assert await sent_to(router, LONG_PROMPT, PARAMS) == "a"  # both idle: the first by name
    a.backlog_s = 0.05  # a little busy: fresh work would start sooner on b
    assert await sent_to(router, list(range(5000, 5200)), PARAMS) == "b"  # another prompt
    # The same prefix again: recomputing its 320 tokens on b takes longer than a's queue.
    assert await sent_to(router, [*LONG_PROMPT, 7, 8], PARAMS) == "a"
    # Another tenant's cache never holds this tenant's blocks: for it a holds nothing.
    other = PlainParams(max_tokens=2, cache_salt="tenant:other")
    assert await sent_to(router, LONG_PROMPT, other) == "b"
    # Busier than recomputing the prefix elsewhere: the idle replica wins.
    a.backlog_s = 5.0
    assert await sent_to(router, LONG_PROMPT, PARAMS) == "b"
    assert [len(s[1][0]) for s in a.streams] == [320, 322]


async def test_a_new_prompt_goes_where_the_fleets_least_recently_used_blocks_are() -> None:
    """Replicas alike in load: a prompt no replica caches goes where the router's estimate of
    the caches has room for it, else where the block it evicts was used longest ago, so that
    one replica's cache does not churn while another's stands empty."""
    a, b = ScriptedReplica("a", capacity=30), ScriptedReplica("b", capacity=30)
    router = await router_over(a, b, placement="expected_wait")
    first, second, third = (list(range(n, n + 320)) for n in (10_000, 20_000, 30_000))
    assert await sent_to(router, first, PARAMS) == "a"  # both empty: the first by name
    assert await sent_to(router, second, PARAMS) == "b"  # a's 30 blocks cannot take 20 more
    assert await sent_to(router, third, PARAMS) == "a"  # both full: a's blocks are older
    assert await sent_to(router, [*second, 7, 8], PARAMS) == "b"  # b still holds second
