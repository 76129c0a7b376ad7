"""`WiMDocumentKV`: the project's vLLM KV connector (vLLM 0.32 `KVConnectorBase_V1`).

vLLM builds it from `KVTransferConfig(kv_connector="WiMDocumentKV",
kv_connector_module_path=MODULE, kv_role="kv_both")` (`connector_config`): once in the engine
core (scheduler role, `planner.Planner`) and once in each worker (`worker.WorkerSide`). Each
builds its own store access from the environment (`documents.DocumentKV.from_env`): keys and
store credentials are never in vLLM's config, which vLLM logs. Importing this module also adds
two utility methods to `EngineCore`, called from the front end with
`engine_core.call_utility_async(name, ...)`: `wim_kv_signature` (what the front end checks a
manifest against before a restore, off the engine core) and `wim_kv_report` (what a context
restored and saved).

It is a best-effort cache, not a hand-off: a request never waits on it (loads and saves are
synchronous in the step, `requires_kv_delivery` is False), and it never fails one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.engine.core import EngineCore

from wim_service.engine.kv_transfer.documents import DocumentKV
from wim_service.engine.kv_transfer.jobs import StepJobs, WorkerResults
from wim_service.engine.kv_transfer.objects import engine_signature
from wim_service.engine.kv_transfer.planner import Planner
from wim_service.engine.kv_transfer.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)

MODULE = "wim_service.engine.kv_transfer.connector"
NAME = "WiMDocumentKV"


def connector_config() -> dict[str, Any]:
    """`AsyncEngineArgs(kv_transfer_config=...)` for an engine that saves and restores."""
    return {
        "kv_connector": NAME,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        # A block that fails its check is recomputed, never served: the request goes on.
        "kv_load_failure_policy": "recompute",
    }


class WiMDocumentKV(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = DocumentKV.from_env()
        if str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
            # A quantized cache's scales live beside the blocks, not in them: not stored.
            logger.warning("stored document KV is off: quantized KV caches are not supported")
            kv = None
        self.block_size: int = vllm_config.cache_config.block_size
        self.signature, _ = engine_signature(vllm_config, kv_cache_config)
        self._num_blocks: int = kv_cache_config.num_blocks
        self.planner = Planner(kv, self.signature, self.block_size)
        self.worker = WorkerSide(kv, self.block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.worker.register(kv_caches, self._num_blocks, get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        jobs = self._get_connector_metadata()
        assert isinstance(jobs, StepJobs)
        if jobs.loads:
            self.worker.load(jobs.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves copy whole blocks of every layer after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        jobs = self._get_connector_metadata()
        assert isinstance(jobs, StepJobs)
        if jobs.saves:
            self.worker.save(jobs.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self.worker.results:
            return None
        results, self.worker.results = self.worker.results, {}
        return WorkerResults(results)

    # -- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.planner.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.planner.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.planner.allocated(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.planner.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, WorkerResults):
            self.planner.update(meta.results)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.planner.finished(request)
        return False, None


def _connector(core: EngineCore) -> WiMDocumentKV:
    connector = core.scheduler.connector
    assert isinstance(connector, WiMDocumentKV)
    return connector


def _engine_wim_kv_signature(self: EngineCore) -> dict[str, Any]:
    connector = _connector(self)
    return {"signature": connector.signature, "block_size": connector.block_size}


def _engine_wim_kv_report(self: EngineCore, open_id: str) -> dict[str, Any]:
    return dict(_connector(self).planner.report(open_id))


EngineCore.wim_kv_signature = _engine_wim_kv_signature
EngineCore.wim_kv_report = _engine_wim_kv_report
