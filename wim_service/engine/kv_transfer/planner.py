"""The connector's scheduler side (in the engine core): which blocks to restore and to save.

* Only requests whose `kv_transfer_params` carry `wim_kv` (set by the engine layer for a
  stored document's spine, `documents.spine_extra_args`) take part; every other request costs
  one dictionary lookup.
* **Restore** (`matched`, vLLM's `get_num_new_matched_tokens`, asked once, at the spine's first
  scheduling): the manifest is read and checked (it opens under the tenant's key; same tenant,
  document, engine signature, block size; the token chain of the spine's own tokens matches);
  any failure matches 0 tokens, with the reason kept for the report. Otherwise the whole blocks
  the manifest holds, short of the last token, are loaded before this step's forward.
* **Save** (`build`): every step, a spine's blocks that this step fills with document tokens
  are planned for saving, while its current push carries `wim_kv` (a conclusion's push does
  not: its blocks hold a query). A save that fails stops that spine's saving: the manifest
  only ever names blocks 0..n-1 that were all written.
* **Report**: per context (open id), what was restored and saved, from the workers' results
  (`update`), for the front end's `EngineCore.wim_kv_report`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from wim_service.engine.kv_transfer.documents import PARAMS_KEY, DocumentKV
from wim_service.engine.kv_transfer.jobs import LoadJob, OpenResult, SaveJob, StepJobs
from wim_service.engine.kv_transfer.keys import StoredDocument
from wim_service.engine.kv_transfer.objects import token_chain

logger = logging.getLogger(__name__)

_REPORTS_KEPT = 4096


def wim_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    value = (params or {}).get(PARAMS_KEY)
    return value if isinstance(value, dict) else None


@dataclass
class _Spine:
    request: Any  # vllm.v1.request.Request
    doc: StoredDocument
    open_id: str
    restore: bool
    saved: int = 0  # blocks saved, planned for saving, or restored
    chain: list[bytes] = field(default_factory=list)
    stopped: bool = False


def _report() -> dict[str, Any]:
    return {
        "restored_tokens": 0,
        "restore_reason": None,
        "restore_seconds": 0.0,
        "saved_tokens": 0,
        "saved_bytes": 0,
        "save_failed": None,
    }


class Planner:
    def __init__(self, kv: DocumentKV | None, signature: str, block_size: int) -> None:
        self.kv = kv
        self.signature = signature
        self.block_size = block_size
        self._spines: dict[str, _Spine] = {}
        self._matches: dict[str, tuple[int, int]] = {}  # request -> (first block, end block)
        self._loads: list[LoadJob] = []
        self._reports: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def report(self, open_id: str) -> dict[str, Any]:
        if open_id not in self._reports:
            self._reports[open_id] = _report()
            while len(self._reports) > _REPORTS_KEPT:
                self._reports.popitem(last=False)
        return self._reports[open_id]

    def on_new_request(self, request: Any) -> None:
        params = wim_params(request.kv_transfer_params)
        if params is None or self.kv is None:
            return
        tenant, document, open_id = (params.get(name) for name in ("tenant", "document", "open"))
        if not (isinstance(tenant, str) and isinstance(document, str) and isinstance(open_id, str)):
            logger.warning("a request's wim_kv parameters are malformed: not stored")
            return
        doc = StoredDocument(tenant, document)
        spine = _Spine(request, doc, open_id, params.get("restore") is True)
        self._spines[request.request_id] = spine
        self.report(spine.open_id)

    def check(self, doc: StoredDocument, token_ids: list[int]) -> tuple[int, str | None]:
        """Whole blocks of `token_ids` restorable from `doc`'s stored KV, or 0 and why not."""
        if self.kv is None:
            return 0, "disabled"
        return self.kv.restorable(doc, self.signature, self.block_size, token_ids)

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens to load for `request` beyond its `num_computed_tokens` local hit."""
        spine = self._spines.get(request.request_id)
        if spine is None or not spine.restore:
            return 0
        blocks, reason = self.check(spine.doc, list(request.all_token_ids))
        self.report(spine.open_id)["restore_reason"] = reason
        first = num_computed_tokens // self.block_size
        if blocks <= first:
            return 0
        self._matches[request.request_id] = (first, blocks)
        return blocks * self.block_size - num_computed_tokens

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        spine = self._spines.get(request.request_id)
        if match is None or spine is None or num_external_tokens <= 0:
            return
        first, end = match
        spine.chain = token_chain(list(request.all_token_ids), self.block_size, end)
        spine.saved = end  # restored blocks are in the store already
        self._loads.append(
            LoadJob(
                spine.open_id,
                spine.doc,
                self.signature,
                first,
                block_ids[first:end],
                spine.chain[first:end],
            )
        )

    def build(self, scheduler_output: Any) -> StepJobs:
        jobs = StepJobs(loads=self._loads)
        self._loads = []
        state = scheduler_output.kv_connector_block_state
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            spine = self._spines.get(request_id)
            if spine is not None and state is not None and not spine.stopped:
                job = self._save_job(spine, scheduled, state)
                if job is not None:
                    jobs.saves.append(job)
        return jobs

    def _save_job(self, spine: _Spine, scheduled: int, state: Any) -> SaveJob | None:
        request = spine.request
        current = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        if wim_params(current.get("kv_transfer_params")) is None:
            return None  # a conclusion's push: its blocks hold the query, not the document
        end = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens)
        full = end // self.block_size
        if full <= spine.saved:
            return None
        block_ids = state.get_block_ids(request.request_id)[0]
        spine.chain = token_chain(list(request.all_token_ids), self.block_size, full, spine.chain)
        first, spine.saved = spine.saved, full
        return SaveJob(
            spine.open_id, spine.doc, self.signature, first, block_ids[first:full], spine.chain
        )

    def update(self, results: dict[str, OpenResult]) -> None:
        for open_id, result in results.items():
            report = self.report(open_id)
            if result.load_failed:
                report["restore_reason"] = result.load_failed
                logger.warning("KV restore falls back to a recompute: %s", result.load_failed)
                # vLLM recomputes the spine from token 0: its blocks are saved again, which
                # repairs the stored copy that failed.
                for spine in self._by_open(open_id):
                    spine.saved = 0
            elif result.loaded_blocks:
                report["restored_tokens"] += result.loaded_blocks * self.block_size
                report["restore_seconds"] += result.load_seconds
            report["saved_tokens"] += result.saved_blocks * self.block_size
            report["saved_bytes"] += result.saved_bytes
            if result.save_failed and not report["save_failed"]:
                report["save_failed"] = result.save_failed
                logger.warning("KV save of a document stopped: %s", result.save_failed)
                for spine in self._by_open(open_id):
                    spine.stopped = True

    def _by_open(self, open_id: str) -> list[_Spine]:
        return [spine for spine in self._spines.values() if spine.open_id == open_id]

    def finished(self, request: Any) -> None:
        self._spines.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
