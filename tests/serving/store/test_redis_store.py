"""The Redis session store's own promises on a real redis-server: keys that expire by TTL,
documents and options stored sealed, and an outage raised as `StoreUnavailable` and recovered.
The contract both backends keep is in test_session_store.py."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from redis import exceptions as redis_errors

from tests.harness.redis_server import RedisServer, redis_binary
from tests.serving.store.test_session_store import (
    CONFIG,
    OPTIONS,
    TEXT,
    redis_config,
    session,
)
from wim_service.serving.store import (
    StoreUnavailable,
)
from wim_service.serving.store.cipher import ENCRYPTION_KEY_ENV, DocumentCipher
from wim_service.serving.store.redis_store import RedisSessionStore, connect, not_run


async def test_redis_drops_the_keys_by_ttl_and_delete_removes_the_document(
    redis_server: RedisServer,
) -> None:
    config = redis_config(**CONFIG)
    store = RedisSessionStore(connect(redis_server.url, config), config)
    raw = redis_server.client()
    try:
        expiring, deleted = session(ttl_s=0.2), session()
        for new in (expiring, deleted):
            await store.create(new, TEXT)
        assert set(raw.keys(config.key_prefix + "*")) == {
            f"{config.key_prefix}{{{s.session_id}}}:{k}".encode()
            for s in (expiring, deleted)
            for k in "sd"
        } | {f"{config.key_prefix}expiry".encode()}
        assert 0 < raw.pttl(f"{config.key_prefix}{{{expiring.session_id}}}:d") <= 500
        await store.delete(deleted.session_id)
        assert raw.keys(f"{config.key_prefix}{{{deleted.session_id}}}:*") == [
            f"{config.key_prefix}{{{deleted.session_id}}}:t".encode()
        ]
        assert 0 < raw.pttl(f"{config.key_prefix}{{{deleted.session_id}}}:t") <= 30_000
        # Expiry (0.2 s) plus grace (0.3 s): Redis itself drops the session, swept or not.
        await asyncio.sleep(0.7)
        assert raw.keys(f"{config.key_prefix}{{{expiring.session_id}}}:*") == []
        assert await store.sweep() == []  # Redis dropped it first: nothing left to close
        assert raw.zcard(f"{config.key_prefix}expiry") == 0
    finally:
        raw.close()
        await store.close()


async def test_redis_stores_documents_encrypted(redis_server: RedisServer) -> None:
    config = redis_config()
    key = os.urandom(32)
    store = RedisSessionStore(connect(redis_server.url, config), config, DocumentCipher(key))
    raw = redis_server.client()
    try:
        one, two = session(), session()
        for new in (one, two):
            await store.create(new, TEXT)
        sealed = [raw.get(f"{config.key_prefix}{{{s.session_id}}}:d") for s in (one, two)]
        for value in sealed:
            assert b"4417" not in value and b"Marta" not in value and b"night gate" not in value
        assert sealed[0] != sealed[1]  # a fresh nonce per write
        assert await store.text(one.session_id) == TEXT
        # Bound to its session: moved under another session's key it does not decrypt.
        raw.set(f"{config.key_prefix}{{{two.session_id}}}:d", sealed[0])
        with pytest.raises(InvalidTag):
            await store.text(two.session_id)
        # Read without the key (or with another): refused, never garbage.
        for cipher in (DocumentCipher(None), DocumentCipher(os.urandom(32))):
            other = RedisSessionStore(connect(redis_server.url, config), config, cipher)
            with pytest.raises((ValueError, InvalidTag)):
                await other.text(one.session_id)
            await other.close()
    finally:
        raw.close()
        await store.close()


async def test_redis_stores_options_sealed_like_the_text(redis_server: RedisServer) -> None:
    """A session's options carry its prompts, which may quote a customer's words: with a key
    they are sealed like the text, bound to their session, read back whole, and refused
    without the key; without a key they stay JSON, as every router before wrote them."""
    config = redis_config()
    prompts = OPTIONS.prompts.model_copy(update={"system": "You read Marta's harbour file."})
    options = OPTIONS.model_copy(update={"prompts": prompts})
    keyed, plain, keyless = (
        RedisSessionStore(connect(redis_server.url, config), config, cipher)
        for cipher in (DocumentCipher(os.urandom(32)), DocumentCipher(None), DocumentCipher(None))
    )
    raw = redis_server.client()
    try:
        one, two = replace(session(), options=options), replace(session(), options=options)
        await keyed.create(one, TEXT)
        await plain.create(two, TEXT)
        stored = {
            s.session_id: raw.hget(f"{config.key_prefix}{{{s.session_id}}}:s", "options")
            for s in (one, two)
        }
        assert b"Marta" not in stored[one.session_id]
        assert b"segment_tokens" not in stored[one.session_id]
        assert stored[two.session_id].startswith(b"{") and b"Marta" in stored[two.session_id]
        for store, new in ((keyed, one), (keyed, two), (plain, two)):
            got = await store.get(new.session_id)
            assert got is not None and got.options == options
        with pytest.raises(ValueError, match=ENCRYPTION_KEY_ENV):
            await keyless.get(one.session_id)
    finally:
        raw.close()
        for store in (keyed, plain, keyless):
            await store.close()


async def test_redis_outage_raises_store_unavailable_and_recovers(tmp_path: Path) -> None:
    server = RedisServer(redis_binary(), tmp_path).start()
    config = redis_config(timeout_s=0.5, connect_timeout_s=0.5, outage_wait_s=0)
    store = RedisSessionStore(connect(server.url, config), config)
    try:
        new = session()
        await store.create(new, TEXT)
        assert await store.get(new.session_id) is not None
        server.stop()
        calls: list[Callable[[], object]] = [
            lambda: store.create(session(), TEXT),
            lambda: store.get(new.session_id),
            lambda: store.text(new.session_id),
            lambda: store.touch(new.session_id),
            lambda: store.rebind(new.session_id, None, "r1"),
            lambda: store.delete(new.session_id),
            store.sweep,
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call()  # type: ignore[misc]
            assert time.monotonic() - started < 1.0  # refused: fails fast (0.1 s measured)
        # A Redis that accepts connections but never answers is unavailable too.
        server.start()
        assert await store.create(new, TEXT)  # persistence is off: the restart lost it
        server.pause()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get(new.session_id)
        assert time.monotonic() - started < 2.0  # two reads of 0.5 s (1.1 s measured)
        server.resume()
        again = session()
        await store.create(again, TEXT)
        assert (await store.get(again.session_id)) is not None
        assert await store.text(again.session_id) == TEXT
    finally:
        server.stop()
        await store.close()


async def test_a_restarting_redis_holds_calls_instead_of_refusing_them(tmp_path: Path) -> None:
    """A call that finds Redis down waits for it (up to `outage_wait_s`) and runs once it is
    back; a call cut off after it was sent (Redis stalled) is not tried again."""
    server = RedisServer(redis_binary(), tmp_path).start()
    config = redis_config(timeout_s=0.5, connect_timeout_s=0.5, outage_wait_s=30)
    store = RedisSessionStore(connect(server.url, config), config)
    try:
        server.stop()
        restarted = asyncio.get_running_loop().run_in_executor(None, restart, server)
        new = session()
        await store.create(new, TEXT)  # sent while Redis was down
        await restarted
        assert await store.text(new.session_id) == TEXT
        server.pause()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get(new.session_id)
        assert time.monotonic() - started < config.outage_wait_s  # not held: it may have run
        server.resume()
    finally:
        server.stop()
        await store.close()


def restart(server: RedisServer) -> None:
    time.sleep(1.0)  # the store's call has been refused a few times by now
    server.start()


def test_only_calls_redis_never_ran_count_as_not_run() -> None:
    refused = redis_errors.ConnectionError("Error 111 connecting")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    cut = redis_errors.ConnectionError("Error while reading")
    cut.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    assert not_run(refused)
    assert not_run(redis_errors.BusyLoadingError("Redis is loading the dataset in memory"))
    assert not_run(redis_errors.ReadOnlyError("You can't write against a read only replica"))
    # A connect that found no route (a blackhole route answers EINVAL), as redis-py words it.
    unrouted = redis_errors.ConnectionError(
        "Error 22 connecting to 10.0.0.9:6379. Invalid argument."
    )
    unrouted.__cause__ = OSError(22, "Invalid argument")
    assert not_run(unrouted)
    assert not not_run(cut)
    assert not not_run(redis_errors.TimeoutError("Timeout reading from 127.0.0.1:6379"))
    assert not not_run(None)


async def test_a_connect_that_timed_out_counts_as_not_run() -> None:
    """A Redis host that drops packets (cut off the network) fails the connect by its timeout:
    nothing was sent, so the call is held like a refused one. The error is redis-py's own: a
    listener whose accept queue is full drops the connect's SYN, as such a host does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    host, port = listener.getsockname()
    queued = [socket.socket() for _ in range(3)]
    config = redis_config(timeout_s=0.5, connect_timeout_s=0.2, outage_wait_s=0)
    client = connect(f"redis://{host}:{port}", config)
    try:
        for sock in queued:
            sock.setblocking(False)
            sock.connect_ex((host, port))  # fills the accept queue, then waits on it
        with pytest.raises(redis_errors.TimeoutError) as timed_out:
            await client.ping()
    finally:
        await client.aclose()
        for sock in [*queued, listener]:
            sock.close()
    assert not_run(timed_out.value)
