"""The router's part in stored document KV (`serving/routing/stored_kv.py`), over fake replicas
that share a fake KV store and a real directory store the router deletes from (no engine).
The engine's own save and restore: tests/engine/kv_transfer/test_kv_restore.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from tests.fakes.replicas import DOCUMENT, FakeReplica
from tests.fakes.router import make_service, metric
from wim_service.engine.kv_transfer.documents import DocumentKV
from wim_service.engine.kv_transfer.keys import KVCipher
from wim_service.engine.kv_transfer.store import DirectoryKVStore
from wim_service.serving.observability.metrics import StoredKVMetrics, WiMMetrics
from wim_service.serving.replica.contracts import OpenResult
from wim_service.serving.routing.stored_kv import StoredKV
from wim_service.wim.backend import StoredDocument
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import ErrorEvent
from wim_service.wim.options import WiMOptions

SAVED = b"sealed block" * 100


def stored_kv(tmp_path: Path) -> DocumentKV:
    return DocumentKV(DirectoryKVStore(tmp_path, 2**30), KVCipher(os.urandom(32)))


def test_a_rebuild_restores_and_counts_no_re_read_and_delete_purges_the_store(
    tmp_path: Path,
) -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    a.kv_store = b.kv_store = set()  # the replicas' engines share one store
    client, router = make_service(a, b)
    store = router.dispatcher.stored_kv.store = stored_kv(tmp_path)
    opened = client.post("/documents", json={"context": DOCUMENT})
    assert opened.status_code == 201, opened.text
    document_id = opened.json()["document_id"]
    # A new document is read, not restored: nothing can be stored under a new id.
    assert a.opens == [("", document_id, False)]
    store.put(StoredDocument("", document_id), "0", "engine", SAVED)  # what its engine saved
    assert metric(client, "wim_kv_store_bytes") == 0  # measured every 15 s, not yet
    a.dead = True
    answer = client.post("/wim", json={"document_id": document_id, "query": "code?"})
    assert answer.status_code == 200 and answer.json()["replica"] == "b"
    # Rebuilt on b by restoring what a saved: no token computed again.
    assert b.opens == [("", document_id, True)]
    assert metric(client, "wim_session_failover_total", reason="replica_lost") == 1
    assert metric(client, "wim_reprefill_tokens_total") == 0
    assert store.total_bytes() > 0
    assert client.delete(f"/documents/{document_id}").status_code == 204
    assert store.total_bytes() == 0  # nothing of the document left in the store


def test_a_rebuild_without_stored_kv_counts_the_whole_re_read() -> None:
    a, b = FakeReplica("a", capacity=100_000), FakeReplica("b")
    client, _ = make_service(a, b)
    document_id = client.post("/documents", json={"context": DOCUMENT}).json()["document_id"]
    a.dead = True
    answer = client.post("/wim", json={"document_id": document_id, "query": "code?"})
    assert answer.status_code == 200
    assert metric(client, "wim_reprefill_tokens_total") == len(DOCUMENT) // 4


class SavesThenFails(FakeReplica):
    """A replica whose engine saved part of the document before the read failed."""

    def __init__(self, name: str, store: DocumentKV) -> None:
        super().__init__(name)
        self.store = store

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        self.store.put(StoredDocument(tenant, document_id), "0", "engine", SAVED)
        return ErrorEvent(code=ErrorCode.OVERLOADED.value, message="the KV filled meanwhile")


def test_a_failed_new_read_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    """What the engine saved of a read that then failed is deleted at once: no session
    names the document."""
    store = stored_kv(tmp_path)
    client, router = make_service(SavesThenFails("a", store))
    router.dispatcher.stored_kv.store = store
    refused = client.post("/documents", json={"context": DOCUMENT})
    assert refused.status_code == 429, refused.text
    assert store.total_bytes() == 0


class CountingReplica(FakeReplica):
    """A replica that restored one document and fell back on another, as its
    `StoredKVMetrics` count them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.registry = CollectorRegistry()
        counts = StoredKVMetrics(self.registry)
        counts.restored_tokens.inc(3000)
        counts.fallbacks.labels("tampered").inc()

    async def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()


def test_the_replicas_stored_kv_counts_reach_metrics_with_their_replica() -> None:
    client, _ = make_service(CountingReplica("a"))
    assert client.get("/readyz").status_code == 200  # the router learns replica "a"
    assert metric(client, "wim_kv_restored_tokens_total", replica="a") == 3000
    assert metric(client, "wim_kv_restore_fallbacks_total", replica="a", reason="tampered") == 1
    assert metric(client, "wim_kv_restore_fallbacks_total", replica="a", reason="digest") == 0
    assert (
        'wim_kv_restore_fallbacks_total{reason="digest",replica="a"}' in client.get("/metrics").text
    )  # exported at 0, not missing


async def test_the_router_deletes_stored_kv_past_its_age_and_measures_the_rest(
    tmp_path: Path,
) -> None:
    """What no router ended (every router gone with its sessions) goes once unused for
    `WIM_KV_STORE_MAX_AGE_H`; any router's sweep deletes it."""
    store = DocumentKV(DirectoryKVStore(tmp_path, 2**30), KVCipher(os.urandom(32)), max_age_s=3600)
    metrics = WiMMetrics()
    stale, kept = StoredDocument("acme", "stale"), StoredDocument("acme", "kept")
    for doc in (stale, kept):
        store.put(doc, "0", "engine", SAVED)
    then = time.time() - 7200
    os.utime(tmp_path / store.cipher.storage_id(stale), (then, then))
    await StoredKV(metrics, store).maintain()
    assert store.get(stale, "0", "engine") is None
    assert store.get(kept, "0", "engine") == SAVED
    exported = generate_latest(metrics.registry).decode()
    assert f"wim_kv_store_bytes {float(store.total_bytes())}" in exported
    assert store.total_bytes() > 0
