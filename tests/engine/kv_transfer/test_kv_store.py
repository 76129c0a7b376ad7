"""Stored document KV, without an engine: keys and sealing, both store backends (bounds,
eviction, deletion, a store that is down), the token chain and manifest, raw block copies on
fake KV tensors, and the connector's restore checks and worker fallbacks on a real store.
The engine end to end (a killed engine, a restore in another process):
tests/engine/kv_transfer/test_kv_restore.py.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.harness.redis_server import RedisServer, free_port
from wim_service.engine.kv_transfer import worker as worker_module
from wim_service.engine.kv_transfer.block_io import BlockIO
from wim_service.engine.kv_transfer.documents import (
    DEFAULT_MAX_AGE_H,
    MAX_AGE_ENV,
    DocumentKV,
    open_store,
)
from wim_service.engine.kv_transfer.jobs import LoadJob, SaveJob
from wim_service.engine.kv_transfer.keys import (
    MASTER_KEY_ENV,
    KVCipher,
    SealError,
    StoredDocument,
    master_key_from_env,
)
from wim_service.engine.kv_transfer.objects import (
    Manifest,
    block_name,
    manifest_name,
    restorable_blocks,
    token_chain,
)
from wim_service.engine.kv_transfer.planner import Planner
from wim_service.engine.kv_transfer.redis_store import RedisKVStore
from wim_service.engine.kv_transfer.store import (
    DirectoryKVStore,
    KVStore,
    StoreFull,
    StoreUnavailable,
)
from wim_service.engine.kv_transfer.worker import WorkerSide

DOC = StoredDocument("tenant-a", "doc-1")
SIG = "f" * 64


@pytest.fixture
def cipher() -> KVCipher:
    return KVCipher(secrets.token_bytes(32))


# -- keys -----------------------------------------------------------------------------------


def test_a_sealed_object_opens_only_where_it_was_sealed(cipher: KVCipher) -> None:
    sealed = cipher.seal(DOC, "block-7", SIG, b"kv bytes")
    assert cipher.open(DOC, "block-7", SIG, sealed) == b"kv bytes"
    for doc, name, sig in [
        (StoredDocument("tenant-b", "doc-1"), "block-7", SIG),  # another tenant
        (StoredDocument("tenant-a", "doc-2"), "block-7", SIG),  # another document
        (DOC, "block-8", SIG),  # another block index
        (DOC, "block-7", "e" * 64),  # another engine
    ]:
        with pytest.raises(SealError):
            cipher.open(doc, name, sig, sealed)
    tampered = bytearray(sealed)
    tampered[-20] ^= 1
    with pytest.raises(SealError):
        cipher.open(DOC, "block-7", SIG, bytes(tampered))
    with pytest.raises(SealError):  # another master key
        KVCipher(secrets.token_bytes(32)).open(DOC, "block-7", SIG, sealed)


def test_tenants_have_their_own_keys_and_store_names(cipher: KVCipher) -> None:
    other = StoredDocument("tenant-b", "doc-1")
    # Same nonce and text: only the key differs, and so does the ciphertext.
    nonce = b"\x00" * 12
    a = cipher._aead(DOC.tenant).encrypt(nonce, b"same", b"")
    b = cipher._aead(other.tenant).encrypt(nonce, b"same", b"")
    assert a != b
    name = cipher.storage_id(DOC)
    assert name != cipher.storage_id(other)
    assert DOC.tenant not in name and DOC.document not in name
    assert name == KVCipher(cipher._master).storage_id(DOC)  # stable across processes


def test_master_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    assert master_key_from_env() is None
    monkeypatch.setenv(MASTER_KEY_ENV, base64.b64encode(b"k" * 32).decode())
    assert master_key_from_env() == b"k" * 32
    for bad in ("not base64!", base64.b64encode(b"short").decode()):
        monkeypatch.setenv(MASTER_KEY_ENV, bad)
        with pytest.raises(ValueError, match=MASTER_KEY_ENV):
            master_key_from_env()


def test_a_store_without_a_master_key_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("WIM_KV_STORE", raising=False)
    assert DocumentKV.from_env() is None
    monkeypatch.setenv("WIM_KV_STORE", str(tmp_path))
    monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=MASTER_KEY_ENV):
        DocumentKV.from_env()


# -- stores ---------------------------------------------------------------------------------


@pytest.fixture(params=["directory", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of empty stores of one backend, bounded by `max_bytes`."""
    if request.param == "directory":
        yield lambda max_bytes: DirectoryKVStore(tmp_path / "kv", max_bytes)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-kv-{secrets.token_hex(4)}:"
    yield lambda max_bytes: RedisKVStore(server.url, max_bytes, prefix=prefix)
    client = server.client()
    for key in client.scan_iter(prefix + "*"):
        client.delete(key)


def test_put_get_and_delete_a_document_leaves_nothing(make_store: Any) -> None:
    store: KVStore = make_store(10_000)
    store.put("doc-a", "manifest-x", b"m")
    store.put("doc-a", "block-x-r0-000000", b"0" * 100)
    store.put("doc-b", "block-x-r0-000000", b"1" * 50)
    assert store.get("doc-a", "block-x-r0-000000") == b"0" * 100
    assert store.get("doc-a", "block-x-r0-000001") is None
    assert store.total_bytes() == 151
    assert store.delete_document("doc-a") == 2
    assert store.get("doc-a", "manifest-x") is None
    assert store.get("doc-a", "block-x-r0-000000") is None
    assert store.documents() == ["doc-b"]
    assert store.total_bytes() == 50
    assert store.delete_document("doc-a") == 0


def test_overwriting_an_object_counts_its_size_once(make_store: Any) -> None:
    store: KVStore = make_store(10_000)
    store.put("doc-a", "manifest-x", b"m" * 10)
    store.put("doc-a", "manifest-x", b"m" * 30)
    assert store.total_bytes() == 30


def test_a_full_store_evicts_least_recently_used_documents_first(make_store: Any) -> None:
    store: KVStore = make_store(300)
    for doc in ("old", "used", "new"):
        store.put(doc, "manifest-x", b"x" * 100)
    assert store.get("used", "manifest-x") is not None  # reading a manifest is a use
    store.put("newest", "manifest-x", b"x" * 100)
    assert sorted(store.documents()) == ["new", "newest", "used"]
    assert store.total_bytes() <= 300


def test_the_document_being_written_is_never_evicted_for_itself(make_store: Any) -> None:
    store: KVStore = make_store(250)
    store.put("other", "manifest-x", b"x" * 100)
    store.put("big", "block-x-r0-000000", b"x" * 150)
    with pytest.raises(StoreFull):
        store.put("big", "block-x-r0-000001", b"x" * 150)
    assert store.documents() == ["big"]  # the other document went first, then nothing fit
    assert store.get("big", "block-x-r0-000000") == b"x" * 150


def last_used_ago(store: KVStore, doc_id: str, seconds: float) -> None:
    """Backdate a document's last use (its folder's mtime, its score in the LRU set)."""
    then = time.time() - seconds
    if isinstance(store, DirectoryKVStore):
        os.utime(store.root / doc_id, (then, then))
    else:
        assert isinstance(store, RedisKVStore)
        store._redis.zadd(store.prefix + "lru", {doc_id: then}, xx=True)


def test_expire_deletes_only_documents_unused_since(make_store: Any) -> None:
    store: KVStore = make_store(10_000)
    for doc in ("stale", "read", "fresh"):
        store.put(doc, "manifest-x", b"x" * 100)
        last_used_ago(store, doc, 7200)
    last_used_ago(store, "fresh", 60)
    assert store.get("read", "manifest-x") is not None  # reading a manifest is a use
    assert store.expire(time.time() - 3600) == 1
    assert sorted(store.documents()) == ["fresh", "read"]
    assert store.total_bytes() == 200
    assert store.expire(time.time() - 3600) == 0


def test_the_stores_age_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WIM_KV_STORE", str(tmp_path))
    monkeypatch.setenv(MASTER_KEY_ENV, base64.b64encode(b"k" * 32).decode())
    monkeypatch.delenv(MAX_AGE_ENV, raising=False)
    kv = DocumentKV.from_env()
    assert kv is not None and kv.max_age_s == DEFAULT_MAX_AGE_H * 3600
    monkeypatch.setenv(MAX_AGE_ENV, "0.5")
    kv = DocumentKV.from_env()
    assert kv is not None and kv.max_age_s == 1800
    for bad in ("0", "-1"):
        monkeypatch.setenv(MAX_AGE_ENV, bad)
        with pytest.raises(ValueError, match=MAX_AGE_ENV):
            DocumentKV.from_env()


def test_a_store_that_is_down_raises_store_unavailable(tmp_path: Path) -> None:
    down = RedisKVStore(f"redis://127.0.0.1:{free_port()}/0", 1000)
    with pytest.raises(StoreUnavailable):
        down.get("doc", "manifest-x")
    with pytest.raises(StoreUnavailable):
        down.put("doc", "manifest-x", b"x")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(StoreUnavailable):
        DirectoryKVStore(not_a_dir / "kv", 1000)


def test_open_store_picks_the_backend_from_the_url(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path), 10), DirectoryKVStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0", 10), RedisKVStore)


# -- objects --------------------------------------------------------------------------------


def test_the_token_chain_extends_and_binds_every_earlier_token() -> None:
    ids = list(range(100))
    full = token_chain(ids, 32, 3)
    assert len(full) == 3
    assert token_chain(ids, 32, 3, full[:1]) == full
    assert token_chain(ids, 32, 2, full) == full[:2]
    changed = [7, *ids[1:]]
    assert all(a != b for a, b in zip(token_chain(changed, 32, 3), full, strict=True))


def test_restorable_blocks_leave_the_last_token_and_need_the_same_tokens() -> None:
    ids = list(range(96))
    manifest = Manifest(DOC, SIG, 32, token_chain(ids, 32, 3))
    assert restorable_blocks(manifest, ids) == 2  # 96 tokens: the last block is computed
    assert restorable_blocks(manifest, [*ids, 5]) == 3
    assert restorable_blocks(manifest, ids[:40]) == 1
    assert restorable_blocks(manifest, [1, *ids[1:], 5]) == 0
    assert restorable_blocks(Manifest(DOC, SIG, 32, []), ids) == 0
    assert Manifest.decode(manifest.encode()) == manifest


# -- raw blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((9, 3, 32, 128), torch.float32),
        ((9, 3, 32, 128), torch.bfloat16),
        ((2, 9, 32, 3, 64), torch.float16),
    ],
)
def test_blocks_copy_out_and_back_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    source = {f"layer.{i}": torch.randn(shape).to(dtype) for i in range(3)}
    target = {name: torch.zeros_like(kv) for name, kv in source.items()}
    out, into = BlockIO(source, 9), BlockIO(target, 9)
    assert out.layout() == into.layout()
    payloads = out.read([4, 7])
    assert len(payloads[0]) == out.block_bytes
    into.write([1, 2], payloads)
    dim = 0 if shape[0] == 9 else 1
    for name, kv in source.items():
        assert torch.equal(target[name].select(dim, 1), kv.select(dim, 4))
        assert torch.equal(target[name].select(dim, 2), kv.select(dim, 7))
        assert not target[name].select(dim, 3).any()
    with pytest.raises(ValueError):
        into.write([1], [payloads[0][:-1]])


def test_a_different_layout_has_a_different_digest() -> None:
    a = BlockIO({"l": torch.zeros(9, 3, 32, 128)}, 9)
    b = BlockIO({"l": torch.zeros(9, 2, 32, 128)}, 9)
    c = BlockIO({"l": torch.zeros(9, 3, 32, 128, dtype=torch.bfloat16)}, 9)
    assert len({a.layout(), b.layout(), c.layout()}) == 3


# -- the connector's checks and fallbacks, on a real directory store -------------------------


@pytest.fixture
def kv(tmp_path: Path, cipher: KVCipher) -> DocumentKV:
    return DocumentKV(DirectoryKVStore(tmp_path / "kv", 10**8), cipher)


def _worker(kv: DocumentKV) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = {f"layer.{i}": torch.randn(9, 3, 32, 128) for i in range(2)}
    worker = WorkerSide(kv, 32)
    worker.register(caches, 9, 0)
    return worker, caches


def _save(kv: DocumentKV, ids: list[int], blocks: list[int]) -> dict[str, torch.Tensor]:
    worker, caches = _worker(kv)
    chain = token_chain(ids, 32, len(blocks))
    worker.save([SaveJob("open-1", DOC, SIG, 0, blocks, chain)])
    assert worker.results["open-1"].saved_blocks == len(blocks)
    return caches


@pytest.mark.parametrize("batch", [16, 2])
def test_a_saved_document_restores_bit_for_bit(
    kv: DocumentKV, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    monkeypatch.setattr(worker_module, "LOAD_BATCH_BLOCKS", batch)
    ids = list(range(100))
    saved = _save(kv, ids, [3, 5, 6])
    planner = Planner(kv, SIG, 32)
    assert planner.check(DOC, ids) == (3, None)
    worker, caches = _worker(kv)
    worker.load([LoadJob("open-2", DOC, SIG, 0, [1, 2, 4], token_chain(ids, 32, 3))])
    assert worker.results["open-2"].loaded_blocks == 3
    assert worker.take_load_errors() == set()
    for name, kv_tensor in caches.items():
        assert torch.equal(kv_tensor[[1, 2, 4]], saved[name][[3, 5, 6]])


def test_restore_checks_fall_back_with_a_reason(kv: DocumentKV, cipher: KVCipher) -> None:
    ids = list(range(100))
    _save(kv, ids, [3, 5, 6])
    planner = Planner(kv, SIG, 32)
    assert planner.check(StoredDocument("tenant-b", "doc-1"), ids) == (0, "missing")
    assert planner.check(DOC, [9, *ids[1:]]) == (0, "digest")
    assert Planner(kv, "e" * 64, 32).check(DOC, ids) == (0, "missing")
    assert Planner(None, SIG, 32).check(DOC, ids) == (0, "disabled")
    path = kv.store.root / cipher.storage_id(DOC) / manifest_name(SIG)  # type: ignore[attr-defined]
    sealed = path.read_bytes()
    path.write_bytes(sealed[:-1] + bytes([sealed[-1] ^ 0xFF]))  # always another last byte
    assert planner.check(DOC, ids) == (0, "tampered")
    down = DocumentKV(RedisKVStore(f"redis://127.0.0.1:{free_port()}/0", 10), cipher)
    assert Planner(down, SIG, 32).check(DOC, ids) == (0, "store_down")


@pytest.mark.parametrize("damage", ["tampered", "missing"])
def test_a_block_that_fails_its_check_fails_the_whole_load(
    kv: DocumentKV, cipher: KVCipher, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last block fails, after a first batch of blocks was copied in.
    monkeypatch.setattr(worker_module, "LOAD_BATCH_BLOCKS", 2)
    ids = list(range(100))
    _save(kv, ids, [3, 5, 6])
    block = kv.store.root / cipher.storage_id(DOC) / block_name(SIG, 0, 2)  # type: ignore[attr-defined]
    if damage == "tampered":
        data = bytearray(block.read_bytes())
        data[100] ^= 0xFF
        block.write_bytes(bytes(data))
    else:
        block.unlink()
    worker, _ = _worker(kv)
    worker.load([LoadJob("open-2", DOC, SIG, 0, [1, 2, 4], token_chain(ids, 32, 3))])
    assert worker.results["open-2"].loaded_blocks == 0
    assert worker.results["open-2"].load_failed == "block_check"
    assert worker.take_load_errors() == {1, 2, 4}  # every block: vLLM recomputes from token 0


def test_a_save_to_a_full_store_stops_and_says_so(cipher: KVCipher, tmp_path: Path) -> None:
    small = DocumentKV(DirectoryKVStore(tmp_path / "kv", 100_000), cipher)
    worker, _ = _worker(small)
    worker.save([SaveJob("open-1", DOC, SIG, 0, [1, 2], token_chain(list(range(64)), 32, 2))])
    assert worker.results["open-1"].save_failed == "store_full"
    assert worker.results["open-1"].saved_blocks == 0


def _request(request_id: str, ids: list[int], params: dict[str, Any] | None) -> Any:
    extra = {"kv_transfer_params": params} if params else None
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        sampling_params=SimpleNamespace(extra_args=extra),
        all_token_ids=ids,
        num_computed_tokens=0,
        num_prompt_tokens=len(ids),
    )


def test_the_planner_saves_only_a_stored_spines_document_blocks(kv: DocumentKV) -> None:
    ids = list(range(100))
    planner = Planner(kv, SIG, 32)
    params = {"wim_kv": {"tenant": DOC.tenant, "document": DOC.document, "open": "o"}}
    spine, other = _request("spine", ids, params), _request("other", ids, None)
    planner.on_new_request(spine)
    planner.on_new_request(other)
    state = SimpleNamespace(get_block_ids=lambda rid: ([10, 11, 12, 13],))
    output = SimpleNamespace(
        num_scheduled_tokens={"spine": 70, "other": 100}, kv_connector_block_state=state
    )
    jobs = planner.build(output)
    assert [(j.open_id, j.first_index, j.block_ids) for j in jobs.saves] == [("o", 0, [10, 11])]
    spine.num_computed_tokens = 70
    output.num_scheduled_tokens = {"spine": 30}
    (job,) = planner.build(output).saves
    assert (job.first_index, job.block_ids, len(job.chain)) == (2, [12], 3)
    # A conclusion's push carries its own parameters, without wim_kv: never saved.
    spine.sampling_params = SimpleNamespace(extra_args=None)
    spine.all_token_ids, spine.num_prompt_tokens = [*ids, *range(40)], 140
    spine.num_computed_tokens = 100
    output.num_scheduled_tokens = {"spine": 40}
    assert planner.build(output).saves == []


def test_only_the_engine_layer_names_the_connectors_parameters() -> None:
    """A request takes part in saving or restoring only through `kv_transfer_params`, which
    one function of the engine layer writes (`documents.spine_extra_args`); the one builder of
    every request's sampling parameters never writes them."""
    from wim_service.engine.request_params import sampling_params

    package = Path(__file__).resolve().parents[3] / "wim_service"
    writers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if '"kv_transfer_params"' in path.read_text()
    )
    assert writers == ["engine/kv_transfer/documents.py", "engine/kv_transfer/planner.py"]
    params = sampling_params(4, first_token_ids=[1, 2], stop_token_ids=[3])
    assert "kv_transfer_params" not in (params.extra_args or {})


class _BrokenStore(DirectoryKVStore):
    """A store whose reads and writes fail in a way no backend names (a bug, a driver)."""

    def get(self, doc_id: str, name: str) -> bytes | None:
        raise RuntimeError("unexpected")

    def put(self, doc_id: str, name: str, data: bytes) -> None:
        raise RuntimeError("unexpected")


def test_an_unexpected_failure_is_a_fallback_never_an_engine_error(
    kv: DocumentKV, cipher: KVCipher, tmp_path: Path
) -> None:
    ids = list(range(100))
    _save(kv, ids, [3, 5, 6])
    broken = DocumentKV(_BrokenStore(kv.store.root, 10**8), cipher)  # type: ignore[attr-defined]
    assert Planner(broken, SIG, 32).check(DOC, ids) == (0, "error")
    worker, _ = _worker(broken)
    worker.load([LoadJob("open-2", DOC, SIG, 0, [1, 2, 4], token_chain(ids, 32, 3))])
    assert worker.results["open-2"].load_failed == "block_check"
    assert worker.take_load_errors() == {1, 2, 4}
    worker.save([SaveJob("open-3", DOC, SIG, 0, [1], token_chain(ids, 32, 1))])
    assert worker.results["open-3"].save_failed == "error"


def test_a_worker_that_cannot_read_its_kv_tensors_stores_nothing(kv: DocumentKV) -> None:
    worker = WorkerSide(kv, 32)
    worker.register({"layer.0": torch.zeros(5, 3, 32, 128)}, 9, 0)  # no block dimension
    worker.load([LoadJob("open-1", DOC, SIG, 0, [1], token_chain(list(range(40)), 32, 1))])
    assert worker.take_load_errors() == {1}
    worker.save([SaveJob("open-1", DOC, SIG, 0, [1], token_chain(list(range(40)), 32, 1))])
    assert kv.store.documents() == []


def test_malformed_wim_kv_parameters_take_no_part(kv: DocumentKV) -> None:
    planner = Planner(kv, SIG, 32)
    for params in ({"tenant": "t"}, {"tenant": 1, "document": "d", "open": "o"}):
        request = _request("r", list(range(64)), {"wim_kv": params})
        planner.on_new_request(request)
        output = SimpleNamespace(
            num_scheduled_tokens={"r": 64},
            kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: ([1, 2],)),
        )
        assert planner.build(output).saves == []
        assert planner.matched(request, 0) == 0
