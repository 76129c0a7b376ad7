"""Findings read in the code (issue 40), each shown fixed over fake replicas (no Ray, no
engine): what a request may cost before it is admitted, and what the store's errors become.
docs/security.md names each case and the test that shows it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.test_router_trust import service
from wim_service.serving.http.auth import KeysConfig, hash_key
from wim_service.serving.openai import service as openai_service

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
