"""`wim bench --store`'s Redis (`benchmarks/store.py`, `redis_url`): the project's one
`redis-server` launcher (`benchmarks/redis_server.py`), the tests' too, started for the run
with a password and ended after it."""

from __future__ import annotations

import psutil
import pytest
import redis

from tests.harness.redis_server import redis_binary
from wim_service.benchmarks.store import redis_url


def _redis_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.name() == "redis-server"]


def test_the_store_benchmark_runs_a_redis_of_its_own_and_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    redis_binary()  # skipped without it (failed in CI)
    monkeypatch.delenv("WIM_REDIS_URL", raising=False)
    before = {p.pid for p in _redis_children()}
    with redis_url() as url:
        [server] = [p for p in _redis_children() if p.pid not in before]
        with redis.Redis.from_url(url, socket_timeout=5) as client:
            assert client.ping()
            client.set("k", "v")
            assert client.get("k") == b"v"
        anonymous = redis.Redis.from_url(url.replace(url.split("@")[0], "redis://"))
        with anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE


def test_a_given_redis_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WIM_REDIS_URL", "redis://example.invalid:6379/3")
    before = {p.pid for p in _redis_children()}
    with redis_url() as url:
        assert url == "redis://example.invalid:6379/3"
        assert {p.pid for p in _redis_children()} == before


def test_without_any_redis_the_store_benchmark_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No `WIM_REDIS_URL` and no redis-server to start: `wim bench --store` says what to set,
    one line on stderr and status 1, after the in-process store's figures."""
    from wim_service.cli import main

    monkeypatch.delenv("WIM_REDIS_URL", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["bench", "--store"]) == 1
    out, err = capsys.readouterr()
    assert "in-process store p50 / p99" in out
    assert err == "wim bench: set WIM_REDIS_URL or install redis-server\n"
