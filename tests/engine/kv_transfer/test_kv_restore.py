"""Document KV that outlives its engine, on real engines (fp32, the default model).

Engine process A reads a 1,200-token document segment by segment into a stored context, asks
greedy margins and an answer, and is SIGKILLed with its whole process tree. A new engine
process B restores the document: it computes at most one block and one token of it, and the
same margins and answer come out token for token. With a directory store, B then runs each
fallback (another tenant, other tokens, a store that is down, a tampered block): each loads
nothing, reads or recomputes the document, and still gives the same answer; deleting the
document leaves nothing in the store, and a restore then loads nothing. With a Redis store
(its own server), both engines run bfloat16: B restores (the same bytes, so the same tokens,
where bf16 KV read again segment by segment may differ), then restores while the server is
paused (store down), then deletes.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness.kv_engine_proc import DTYPE_ENV, SEGMENT_TOKENS
from tests.harness.process_tree import ProcessTree
from tests.harness.redis_server import RedisServer, redis_binary
from wim_service.engine.config import EngineConfig

# Four engine starts and several reads of the document: minutes on two busy cores. None uses
# the shared engine, so they run on the cluster tests' worker, which has time to spare.
pytestmark = [pytest.mark.engine, pytest.mark.own_engines, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
BLOCK = EngineConfig().block_size  # the engine process's (`kv_engine_proc.engine_config`)


def _results(tree: ProcessTree) -> dict[str, dict[str, Any]]:
    lines = tree.log.read_text(errors="replace").splitlines()
    found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    return {r["kind"]: r for r in found}


def _run(role: str, store: str, log: Path, env: dict[str, str], *more: str) -> ProcessTree:
    argv = [sys.executable, "-m", "tests.harness.kv_engine_proc", role, store, *more]
    return ProcessTree(argv, log, env=env)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WIM_KV_MASTER_KEY": base64.b64encode(secrets.token_bytes(32)).decode(),
    }


def _save_and_kill(store: str, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Engine A reads the document into `store`, then dies by SIGKILL; what it printed."""
    saver = _run("save", store, log, env)
    try:
        saver.wait_for(lambda _: "saved" in _results(saver), timeout_s=600)
        saver.record()
        saver.root.send_signal(signal.SIGKILL)  # the front end first, then what it leaves
    finally:
        _end(saver)
    return _results(saver)["saved"]


def _end(tree: ProcessTree) -> None:
    """SIGKILL every process of the tree; fail if any outlives it."""
    tree.kill()
    psutil.wait_procs(tree.record(), timeout=30)
    assert not tree.record(), f"left running: {tree.record()}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("kv")
    store, env = str(work / "store"), _env()
    saved = _save_and_kill(store, work / "a.log", env)
    restorer = _run("restore", store, work / "b.log", env)
    try:
        restorer.wait_for(lambda _: "after_delete" in _results(restorer), timeout_s=1200)
        restorer.root.wait(120)
    finally:
        _end(restorer)
    return {"saved": saved, **_results(restorer)}


@pytest.fixture(scope="module")
def redis_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same over Redis: A saves and is killed, B restores; then B restores while the
    server is paused (it accepts connections and never answers), and deletes."""
    work = tmp_path_factory.mktemp("kv-redis")
    server = RedisServer(redis_binary(), work).start()
    go = work / "go"
    os.mkfifo(go)
    try:
        env = {**_env(), DTYPE_ENV: "bfloat16"}
        saved = _save_and_kill(server.url, work / "a.log", env)
        restorer = _run("restore-redis", server.url, work / "b.log", env, str(go))
        try:
            restorer.wait_for(lambda _: "restored" in _results(restorer), timeout_s=600)
            server.pause()
            go.write_text("paused")
            restorer.wait_for(lambda _: "store_down" in _results(restorer), timeout_s=600)
            server.resume()
            go.write_text("resumed")
            restorer.wait_for(lambda _: "deleted" in _results(restorer), timeout_s=120)
            restorer.root.wait(120)
        finally:
            _end(restorer)
        client = server.client()
        left = sorted(key.decode() for key in client.scan_iter("wim-kv:doc:*"))
        return {
            "saved": saved,
            **_results(restorer),
            "left": left,
            "bytes": client.get("wim-kv:bytes"),
        }
    finally:
        server.stop()


def test_a_restored_document_answers_token_for_token(runs: dict[str, dict[str, Any]]) -> None:
    saved, restored = runs["saved"], runs["restored"]
    tokens = saved["tokens"]
    assert tokens > 2 * SEGMENT_TOKENS  # three segments
    assert saved["saved_tokens"] == tokens // BLOCK * BLOCK  # every whole block
    restore = restored["restore"]
    assert restore["fallback"] is None and restore["holds_document"]
    assert restore["computed_tokens"] <= BLOCK + 1
    assert restore["restored_tokens"] + restore["computed_tokens"] == tokens
    assert restored["margins"] == saved["margins"]
    assert restored["answer"] == saved["answer"]
    # The margins and the answer read the restored blocks through the prefix cache.
    ends = [*range(SEGMENT_TOKENS, tokens, SEGMENT_TOKENS), tokens, tokens]
    assert restored["cached"] == [end // BLOCK * BLOCK for end in ends]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("wrong_tenant", "missing"),
        ("store_down", "store_down"),
        ("tampered", "block_check"),
        ("wrong_digest", "digest"),
        ("after_delete", "missing"),
    ],
)
def test_a_failed_check_loads_nothing_and_still_answers(
    runs: dict[str, dict[str, Any]], case: str, reason: str
) -> None:
    outcome = runs[case]
    assert outcome["restore"]["restored_tokens"] == 0
    assert outcome["restore"]["fallback"] == reason
    if case == "after_delete":
        assert not outcome["restore"]["holds_document"]
        return
    if case != "wrong_digest":  # the same document, read again or recomputed
        assert outcome["answer"] == runs["saved"]["answer"]
    assert len(outcome["answer"]) > 0
    if case == "wrong_tenant":  # read segment by segment, as the saving engine did
        assert outcome["margins"] == runs["saved"]["margins"]


def test_a_recomputed_spine_saves_its_blocks_again(runs: dict[str, dict[str, Any]]) -> None:
    """The tampered block failed the whole load; the recompute wrote it again."""
    assert runs["tampered"]["restore"]["holds_document"]
    assert runs["repaired"]["restore"]["fallback"] is None
    assert runs["repaired"]["answer"] == runs["saved"]["answer"]


def test_deleting_a_document_leaves_nothing_in_the_store(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["deleted"]["deleted"] == [True, True]
    assert runs["deleted"]["left"] == []


def test_a_document_restored_from_redis_answers_the_same(redis_runs: dict[str, Any]) -> None:
    """In bfloat16: the restored KV is the saved bytes, so margins and answer are the saving
    engine's token for token."""
    saved, restored = redis_runs["saved"], redis_runs["restored"]
    assert restored["restore"]["fallback"] is None
    assert restored["restore"]["computed_tokens"] <= BLOCK + 1
    assert (restored["margins"], restored["answer"]) == (saved["margins"], saved["answer"])


def test_a_paused_redis_is_a_fallback_that_still_answers(redis_runs: dict[str, Any]) -> None:
    down = redis_runs["store_down"]
    assert down["restore"]["restored_tokens"] == 0
    assert down["restore"]["fallback"] == "store_down"
    assert down["answer"] == redis_runs["saved"]["answer"]


def test_deleting_a_document_leaves_nothing_in_redis(redis_runs: dict[str, Any]) -> None:
    assert redis_runs["deleted"]["deleted"] == [True]
    assert redis_runs["left"] == []
    assert int(redis_runs["bytes"]) == 0
