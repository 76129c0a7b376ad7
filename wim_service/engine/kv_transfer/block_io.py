"""Whole KV blocks in and out of a worker's KV tensors, as raw bytes.

A block is copied byte for byte, every layer, whatever layout the attention backend wrote it
in (the CPU backend's is ISA-specific): nothing here interprets a value, so a block restored
on an engine of the same signature is bit-identical to the one saved. Each layer's tensor has
the pool's blocks along one of its first two dimensions (CPU `[blocks, heads, block_size,
2 * head_size]`; CUDA backends `[2, blocks, ...]` or `[blocks, 2, ...]`); on a GPU the bytes
pass through host memory (`.cpu()`), which is the copy a GPU engine pays.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from wim_service.engine.kv_memory import distinct_kv_layers

if TYPE_CHECKING:
    import torch


class BlockIO:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._layers = distinct_kv_layers(sorted(kv_caches.items()), num_blocks)
        self._sizes = [self._block_bytes(kv, dim) for _, kv, dim in self._layers]
        self.block_bytes = sum(self._sizes)

    @staticmethod
    def _block_bytes(kv: torch.Tensor, dim: int) -> int:
        return kv.select(dim, 0).numel() * kv.element_size()

    def layout(self) -> str:
        """A digest of each layer's name, block shape, dtype and block dimension."""
        text = ";".join(
            f"{name}:{tuple(kv.select(dim, 0).shape)}:{kv.dtype}:{dim}"
            for name, kv, dim in self._layers
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def read(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes, every layer in order."""
        import torch

        per_layer = []
        for _, kv, dim in self._layers:
            index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            blocks = kv.index_select(dim, index).movedim(dim, 0).contiguous().cpu()
            per_layer.append(blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy())
        return [b"".join(layer[i].tobytes() for layer in per_layer) for i in range(len(block_ids))]

    def write(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Copy `payloads` (as `read` made them) into `block_ids`, every layer."""
        import torch

        if any(len(p) != self.block_bytes for p in payloads):
            raise ValueError("a stored block does not have this engine's block size in bytes")
        size = self.block_bytes
        buffer = bytearray(len(payloads) * size)
        for i, payload in enumerate(payloads):
            buffer[i * size : (i + 1) * size] = payload
        rows = torch.frombuffer(buffer, dtype=torch.uint8).view(len(payloads), size)
        offset = 0
        for (_, kv, dim), size in zip(self._layers, self._sizes, strict=True):
            shape = kv.select(dim, 0).shape
            layer = rows[:, offset : offset + size].contiguous().view(kv.dtype)
            layer = layer.view(len(payloads), *shape).movedim(0, dim).to(kv.device)
            index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            kv.index_copy_(dim, index, layer)
            offset += size
