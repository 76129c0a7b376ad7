"""Document KV that outlives its engine: saved as a document is read, restored elsewhere.

The API the serving layer uses (all in `engine/`; nothing here is ever set from a request):

* `backend.open_context(reserve_blocks=n, stored=StoredDocument(tenant, document_id))`: a
  context whose document pushes (`extend`) are saved, write-through, whole blocks at a time.
* `await context.restore(token_ids)`, as the context's *first* push, on any engine: returns a
  `wim.backend.KVRestore` with `restored_tokens`, `computed_tokens`, `seconds` and
  `fallback` (None, or why nothing was restored: "disabled", "missing", "mismatch",
  "digest", "tampered", "block_check", "store_down"). `holds_document` says whether the
  document was pushed; when False nothing was pushed and the caller reads the document as
  usual (segment by segment, still saving). Restored blocks are hashed under the context's
  own cache salt: its margins and answers read them through the prefix cache.
* `await context.kv_report()`: a `vllm_context.KVReport` of what the context restored and
  saved so far (`saved_tokens`, `saved_bytes`, `save_failed`).
* `DocumentKV.from_env()` (`documents`), in any process, an engine or not: `delete(doc)` for
  DELETE, TTL expiry and orphans; `total_bytes()` for `wim_kv_store_bytes`. On an engine
  replica, `backend.delete_stored(doc)`; `backend.kv_restorable(doc, token_ids)` says what a
  restore would load without pushing anything.

Modules: `keys` (per-tenant AES-GCM keys), `store`/`redis_store` (directory and Redis
backends, bounded, LRU eviction), `objects` (engine signature, token chain, manifest),
`documents` (sealed objects in the store), `block_io` (raw blocks in and out of KV tensors),
`jobs`/`planner`/`worker`/`connector` (the vLLM connector). Design: docs/kv-store.md.
"""
