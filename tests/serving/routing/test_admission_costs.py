"""Findings read in the code (issue 40), each shown fixed over fake replicas (no Ray, no
engine): what a request may cost before it is admitted, and what the store's errors become.
docs/security.md names each case and the test that shows it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio
from fastapi.testclient import TestClient
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser as _Parser

from tests.fakes.fake_service import ScriptedClient, ScriptedReplica
from tests.fakes.replicas import DOCUMENT, FakeClient, FakeReplica
from tests.harness.redis_server import RedisServer, redis_binary
from tests.serving.routing.test_router_access import service
from tests.serving.store.test_session_store import TEXT, redis_config, session
from wim_service.engine.admission import AdmissionLoad
from wim_service.engine.config import EngineConfig
from wim_service.placement.backlog import Backlog
from wim_service.placement.profile import EngineProfile
from wim_service.serving.ingress import build_http_app
from wim_service.serving.openai import service as openai_service
from wim_service.serving.replica.deployment import EngineReplica
from wim_service.serving.replica.held_documents import HeldDocuments
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.store import StoreUnavailable
from wim_service.serving.store.redis_store import RedisSessionStore, connect
from wim_service.serving.tenants import ApiKeys, KeysConfig, Tenant, TenantLimits, hash_key

V1_KEYS = KeysConfig.model_validate(
    {
        "tenants": {
            "one": {"keys": [hash_key("one-key")], "limits": {"concurrent_jobs": 1}},
            "docs": {"keys": [hash_key("docs-key")], "allow": ["documents"]},
        }
    }
)


def counting_tokenizations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the chat prompts the `/v1` service tokenizes."""
    calls: list[int] = []
    tokenize = openai_service.chat_prompt_ids

    def counted(*args: Any) -> list[int]:
        calls.append(1)
        return tokenize(*args)

    monkeypatch.setattr(openai_service, "chat_prompt_ids", counted)
    return calls


def test_v1_checks_permission_and_the_job_limit_before_tokenizing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt is tokenized (CPU on the executor that sizes every job) only for a tenant that
    may run jobs and has one free; the refusals come first, at no cost."""
    client, router = service(keys=V1_KEYS)
    tokenized = counting_tokenizations(monkeypatch)
    model = client.get("/v1/models", headers={"Authorization": "Bearer one-key"}).json()
    body = {"model": model["data"][0]["id"], "messages": [{"role": "user", "content": "Hi."}]}

    forbidden = client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": "Bearer docs-key"}
    )
    assert forbidden.status_code == 403 and tokenized == []

    # Tenant `one` runs one job at a time: with it taken, the next prompt is refused untouched.
    asyncio.run(router.gate.store.start_job("one", "running", 1, 60.0))
    one = {"Authorization": "Bearer one-key"}
    busy = client.post("/v1/chat/completions", json=body, headers=one)
    assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
    assert tokenized == []

    asyncio.run(router.gate.store.end_job("one", "running"))
    served = client.post("/v1/chat/completions", json=body, headers=one)
    assert served.status_code == 200 and tokenized == [1]
    # The job took over the lease taken before tokenizing, and gave it back: one slot.
    assert router.gate.store._jobs["one"] == {}
    # A request refused after tokenizing gives its lease back too.
    too_long = client.post("/v1/chat/completions", json={**body, "max_tokens": 10**6}, headers=one)
    assert too_long.status_code == 400 and router.gate.store._jobs["one"] == {}
    assert client.post("/v1/chat/completions", json=body, headers=one).status_code == 200


# -- Redis refusing for a while (OOM, MISCONF, BUSY) -------------------------------------


def redis_store(server: RedisServer) -> RedisSessionStore:
    config = redis_config(timeout_s=5.0)
    return RedisSessionStore(connect(server.url, config), config)


async def test_redis_out_of_memory_is_unavailable_for_now_not_an_error(tmp_path: Path) -> None:
    """A real Redis at `maxmemory` under `noeviction` refuses every script whose first write
    may grow it: the store says unavailable (503 with Retry-After), not a 500 per request."""
    server = RedisServer(redis_binary(), tmp_path).start()
    store, raw = redis_store(server), server.client()
    try:
        new = session()
        await store.create(new, TEXT)
        assert await store.start_job("acme", "job-1", 3, 60.0) is None
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
        # (A script whose first write frees memory, as `start_job`'s, may still run.)
        calls = {
            "touch": lambda: store.touch(new.session_id, 5.0),
            "rebind": lambda: store.rebind(new.session_id, None, "r1"),
            "add_copy": lambda: store.add_copy(new.session_id, "r2", 3),
            "renew_jobs": lambda: store.renew_jobs([("acme", "job-1")], 60.0),
        }
        for call in calls.values():
            with pytest.raises(StoreUnavailable, match="command not allowed"):
                await call()
        raw.config_set("maxmemory", 0)
        assert await store.touch(new.session_id) is not None  # and it passes when Redis can
    finally:
        raw.close()
        await store.close()
        server.stop()


async def test_redis_busy_with_a_script_is_unavailable_for_now(tmp_path: Path) -> None:
    """A long script (someone's `EVAL`) makes Redis answer BUSY to everyone else."""
    server = RedisServer(redis_binary(), tmp_path).start()
    store, raw, looping = redis_store(server), server.client(), server.client()
    raw.config_set("busy-reply-threshold", 1)
    loop = threading.Thread(target=_run_killed, args=(looping, "while true do end"))
    loop.start()
    try:
        _wait_until_busy(raw)
        with pytest.raises(StoreUnavailable, match="BUSY"):
            await store.get("doc-x")
    finally:
        raw.script_kill()
        loop.join()
        looping.close()
        raw.close()
        await store.close()
        server.stop()


def _run_killed(client: redis.Redis, script: str) -> None:
    """Run `script` until SCRIPT KILL ends it."""
    with contextlib.suppress(redis.ResponseError):
        client.eval(script, 0)


def _wait_until_busy(client: redis.Redis) -> None:
    """Return once Redis answers BUSY (the looping script passed the threshold)."""
    while True:
        try:
            client.ping()
        except redis.ResponseError as exc:
            assert str(exc).startswith("BUSY")
            return


class Refusing:
    """A stand-in for a registered script: raises what Redis answered."""

    def __init__(self, error: redis_errors.RedisError) -> None:
        self.error = error

    async def __call__(self, **_: Any) -> Any:
        raise self.error


@pytest.mark.parametrize(
    "answer",
    [
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "NOREPLICAS Not enough good replicas to write.",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
    ],
)
async def test_redis_passing_states_are_unavailable_and_script_bugs_are_not(answer: str) -> None:
    store = RedisSessionStore(redis.asyncio.Redis(), redis_config())
    code = answer.split(" ", 1)[0]
    parsed = _Parser.parse_error(answer)  # as redis-py hands it over
    store._scripts["get"] = Refusing(parsed)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable, match=code):
        await store.get("doc-x")
    store._scripts["get"] = Refusing(_Parser.parse_error("ERR user_script:3: bad argument"))  # type: ignore[assignment]
    with pytest.raises(redis.ResponseError):
        await store.get("doc-x")


def test_a_redis_out_of_memory_answers_503_with_retry_after(tmp_path: Path) -> None:
    """Through HTTP: a query on a document while Redis is out of memory."""
    server = RedisServer(redis_binary(), tmp_path).start()
    raw = server.client()
    try:
        router = WiMRouter(
            None,
            {"router": {"replica_wait_s": 0}},
            client=FakeClient(FakeReplica("a")),
            keys=ApiKeys(V1_KEYS),
            http_host="127.0.0.1",
            store=redis_store(server),
        )
        with TestClient(build_http_app(router)) as client:
            one = {"Authorization": "Bearer one-key"}
            created = client.post("/documents", json={"context": DOCUMENT}, headers=one)
            assert created.status_code == 201
            raw.config_set("maxmemory-policy", "noeviction")
            raw.config_set("maxmemory", 1)
            body = {"document_id": created.json()["document_id"], "query": "q"}
            refused = client.post("/wim", json=body, headers=one)
            assert refused.status_code == 503, refused.text
            assert refused.json()["code"] == "unavailable"
            assert int(refused.headers["Retry-After"]) >= 1
    finally:
        raw.close()
        server.stop()


# -- a replica's load report -------------------------------------------------------------


class HookedSession:
    """A held session whose size, when read, runs `hook` (to change the held documents while
    a load report iterates them)."""

    def __init__(self, tokens: int, hook: Callable[[], None]) -> None:
        self.tokens, self.hook, self.busy = tokens, hook, False

    @property
    def context(self) -> SimpleNamespace:
        self.hook()
        return SimpleNamespace(context_tokens=self.tokens)


async def test_a_load_report_reads_the_held_sessions_whole() -> None:
    """The report sums the held sessions while the event loop may open or close others. Off
    the loop, a document opened by the loop in the middle of the sum broke the iteration
    (`RuntimeError: dictionary changed size during iteration`) and the router missed the
    report; on the loop, nothing runs in between."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    replica = object.__new__(EngineReplica)
    replica.replica, replica.config = "r", EngineConfig()
    replica.backend = SimpleNamespace(
        load=lambda: AdmissionLoad(2, 30, 100, 0), healthy=True, dtype="float32"
    )
    replica.documents = HeldDocuments()
    replica.backlog = Backlog(EngineProfile.load())

    async def held(document_id: str, session: object) -> None:
        async def read() -> Any:
            return session

        await replica.documents.open(document_id, read, time.monotonic)

    def open_another_meanwhile() -> None:
        """Open a third document on the loop, as a request would, if the loop can run now."""
        if threading.get_ident() != loop_thread and len(replica.documents) == 2:
            third = HookedSession(7, lambda: None)
            asyncio.run_coroutine_threadsafe(held("doc-3", third), loop).result()

    await held("doc-1", HookedSession(100, open_another_meanwhile))
    await held("doc-2", HookedSession(20, lambda: None))
    report = await replica.load()
    assert (report.documents, report.resident_kv_tokens) == (2, 120)


# -- bring-up: Ray's token authentication, the tests' Redis password -----------------------

DEPLOY = Path(__file__).parents[3] / "deploy"


def test_a_multi_host_bring_up_sets_ray_token_auth_before_any_ray_start() -> None:
    """Wherever a serve config tells an operator to start Ray on several hosts, Ray's token
    authentication comes first (as docs/deploy.md has it): without it, anyone who reaches
    Ray's ports runs code on every host."""
    multi_host = [p for p in DEPLOY.glob("*.yaml") if "ray start --address" in p.read_text()]
    assert multi_host, "no serve config describes a multi-host bring-up"
    for path in multi_host:
        lines = path.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if re.search(r"ray start --", line)]
        token = [i for i, line in enumerate(lines) if "RAY_AUTH_MODE=token" in line]
        assert token and token[0] < starts[0], path.name
        assert any("RAY_AUTH_TOKEN=" in lines[i] for i in token), path.name


def test_the_tests_redis_needs_its_password(redis_server: RedisServer) -> None:
    """The tests' Redis runs as a deployment's does: a client without the password is
    refused, also on the bridge the multi-node tests reach it through (protected mode alone
    let anyone in there)."""
    anonymous = redis.Redis(host=redis_server.host, port=redis_server.port, socket_timeout=5)
    with pytest.raises(redis_errors.AuthenticationError), anonymous:
        anonymous.ping()
    with redis_server.client() as client:
        assert client.ping()


# -- end users' prefix caches ----------------------------------------------------------------


def test_two_end_users_of_one_tenant_share_no_prefix_cache() -> None:
    """OpenAI's `user` names an end user of the tenant's application: its plain requests get a
    cache salt of their own (vLLM's prefix cache hits only requests of one salt), so one end
    user's `cached_tokens` cannot tell what another sent. The user's id is in no salt."""
    one = Tenant("one", TenantLimits())
    alice, bob = one.salt_for("alice"), one.salt_for("bob")
    salts = {alice, bob, one.cache_salt, Tenant("globex", TenantLimits()).salt_for("alice")}
    assert len(salts) == 4 and one.salt_for("alice") == alice
    assert one.salt_for(None) == one.salt_for("") == one.cache_salt
    assert not any("alice" in salt for salt in salts)

    replica = ScriptedReplica("a")
    client, _ = service(client=ScriptedClient(replica), keys=V1_KEYS)
    headers = {"Authorization": "Bearer one-key"}
    model = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
    for user in ("alice", "bob", None):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "user": user}
        answered = client.post("/v1/chat/completions", json=body, headers=headers)
        assert answered.status_code == 200, answered.text
    sent = [args[1].cache_salt for method, args in replica.streams if method == "complete"]
    assert sent == [alice, bob, one.cache_salt]


# -- the API's docs page -------------------------------------------------------------------


def test_the_docs_page_runs_only_what_its_policy_names() -> None:
    """`/docs` loads Swagger UI from a CDN: its Content-Security-Policy admits exactly the
    page's CDN files and its own start-up script, lets scripts reach this origin only, and
    forbids framing, forms and a changed base URL. ReDoc (more CDN code) is not served."""
    client, _ = service()
    page = client.get("/docs")
    assert page.status_code == 200
    header = page.headers["Content-Security-Policy"]
    policy = dict(d.strip().split(" ", 1) for d in header.split(";"))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    for directive in ("frame-ancestors", "base-uri", "form-action"):
        assert policy[directive] == "'none'", directive
    assert policy["img-src"] == "'self' data:"
    scripts = re.findall(r'<script src="([^"]+)"', page.text)
    (inline,) = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
    assert sorted(policy["script-src"].split()) == sorted([*scripts, f"'sha256-{digest}'"])
    styles = re.findall(r'rel="stylesheet" href="([^"]+)"', page.text)
    assert policy["style-src"].split() == [*styles, "'unsafe-inline'"]
    assert "unsafe-eval" not in header and page.headers["X-Content-Type-Options"] == "nosniff"
    assert "https://" not in re.sub(r'(src|href)="https://cdn\.jsdelivr\.net/[^"]+"', "", page.text)
    assert client.get("/redoc").status_code == 404
