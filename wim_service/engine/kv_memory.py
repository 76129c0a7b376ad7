"""Zero and inspect KV cache blocks inside vLLM's workers: a `worker_extension_cls`.

An engine started with `worker_extension_cls=EXTENSION` gets this class mixed into its worker
class; each method then runs in every worker through `collective_rpc(name, args=...)`, from the
engine core (`EngineCore.collective_rpc`, as the scheduler's purge does) or from the front end
(`AsyncLLM.collective_rpc`, as the tests do to read purged blocks back).

Every attention layer's KV tensor has the pool's blocks along one of its first two dimensions
(CPU: `[num_blocks, heads, block_size, 2 * head_size]`; CUDA backends: `[2, num_blocks, ...]`);
a layer whose tensor has neither is refused rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from wim_service.engine.lifetime import die_with_multiprocessing_parent

if TYPE_CHECKING:
    import torch

# vLLM imports this module by name when a worker starts, before the model loads: in a worker
# process of its own (a GPU's) the first code of ours there. A worker whose EngineCore was
# killed outright was seen running for ~3 minutes more (vLLM's death pipe did not end it
# sooner); from here on the kernel ends it with its EngineCore. In the EngineCore (a CPU's
# worker) it repeats what the scheduler asked; a no-op in a main process (a Ray worker).
die_with_multiprocessing_parent()

EXTENSION = "wim_service.engine.kv_memory.KVMemoryExtension"
ZERO_BLOCKS = "wim_zero_kv_blocks"
BLOCK_MAGNITUDES = "wim_kv_block_magnitudes"


def distinct_kv_layers(
    layers: Iterable[tuple[str, torch.Tensor]], num_blocks: int
) -> list[tuple[str, torch.Tensor, int]]:
    """Each distinct KV tensor (layers may share one), named, with the dimension that
    indexes blocks."""
    found, seen = [], set()
    for name, kv in layers:
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        dims = [d for d in (0, 1) if kv.shape[d] == num_blocks]
        if not dims:
            raise RuntimeError(f"KV tensor {name} {tuple(kv.shape)} has no block dimension")
        found.append((name, kv, dims[0]))
    return found


class KVMemoryExtension:
    """Methods run inside a vLLM worker (`self` is the worker)."""

    model_runner: Any

    def _wim_kv_layers(self, block_ids: list[int]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Each distinct KV tensor, the dimension that indexes blocks, `block_ids` as an index."""
        import torch

        num_blocks = self.model_runner.kv_cache_config.num_blocks
        named = ((str(i), kv) for i, kv in enumerate(self.model_runner.kv_caches))
        return [
            (kv, dim, torch.tensor(block_ids, dtype=torch.long, device=kv.device))
            for _, kv, dim in distinct_kv_layers(named, num_blocks)
        ]

    def wim_zero_kv_blocks(self, block_ids: list[int]) -> None:
        """Overwrite the KV memory of `block_ids` with zeros in every layer."""
        for kv, dim, index in self._wim_kv_layers(block_ids):
            kv.index_fill_(dim, index, 0)

    def wim_kv_block_magnitudes(self, block_ids: list[int]) -> list[float]:
        """The largest absolute KV value of each block over every layer (0.0: all zeros)."""
        import torch

        largest = torch.zeros(len(block_ids))
        for kv, dim, index in self._wim_kv_layers(block_ids):
            blocks = kv.index_select(dim, index)
            values = blocks.movedim(dim, 0).reshape(len(block_ids), -1).abs().amax(dim=1)
            largest = torch.maximum(largest, values.float().cpu())
        return largest.tolist()
