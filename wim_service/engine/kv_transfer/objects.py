"""What a stored document's KV is made of, and what makes it readable.

* The **engine signature**: a digest of everything that decides how a KV block's bytes are
  laid out and what they mean: the model (its `config.json` and weight files' names and
  sizes), the KV dtype, block size, each KV group's layer names and shapes, the tensor-parallel
  size, the device kind and, on a CPU, the attention ISA that wrote the block
  (`cpu_attn._get_attn_isa`: `amx`, `vec`, ...). Objects are named and sealed under it: an
  engine of another signature finds nothing, or nothing that opens.
* The **token chain**: `chain[i]` is a SHA-256 over the document's tokens up to the end of
  block `i` (each link hashes the previous one and the block's token ids). A block is restored
  only where the new spine's own tokens give the same link.
* The **manifest** (one per document and signature): the tenant, the document, the signature,
  the block size and the chain of the blocks saved so far, as JSON, sealed like every object.
* A **block** object: one KV block of every layer, raw bytes, layers in the worker's order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wim_service.engine.kv_transfer.keys import StoredDocument
from wim_service.engine.kv_transfer.store import MANIFEST

FORMAT_VERSION = 1
_CHAIN_SEED = hashlib.sha256(b"wim-kv token chain").digest()


def token_chain(
    token_ids: list[int], block_size: int, blocks: int, known: list[bytes] | None = None
) -> list[bytes]:
    """The chain links of the first `blocks` full blocks of `token_ids`; `known` links (of
    the same tokens) are kept, not hashed again."""
    links = list(known or [])
    link = links[-1] if links else _CHAIN_SEED
    for i in range(len(links), min(blocks, len(token_ids) // block_size)):
        ids = token_ids[i * block_size : (i + 1) * block_size]
        link = hashlib.sha256(link + struct.pack(f"<{len(ids)}I", *ids)).digest()
        links.append(link)
    return links[:blocks]


def manifest_name(signature: str) -> str:
    return f"{MANIFEST}-{signature[:24]}"


def block_name(signature: str, rank: int, index: int) -> str:
    return f"block-{signature[:24]}-r{rank}-{index:06d}"


@dataclass(frozen=True)
class Manifest:
    doc: StoredDocument
    signature: str
    block_size: int
    chain: list[bytes]

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_VERSION,
                "tenant": self.doc.tenant,
                "document": self.doc.document,
                "signature": self.signature,
                "block_size": self.block_size,
                "chain": [link.hex() for link in self.chain],
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(f"manifest format {raw.get('format')}")
        return cls(
            doc=StoredDocument(raw["tenant"], raw["document"]),
            signature=raw["signature"],
            block_size=int(raw["block_size"]),
            chain=[bytes.fromhex(link) for link in raw["chain"]],
        )


def restorable_blocks(manifest: Manifest, token_ids: list[int]) -> int:
    """Whole blocks of `token_ids` the manifest's blocks hold, leaving the last token to
    compute (the engine must compute at least one). 0 unless the chains agree."""
    usable = min(len(manifest.chain), (len(token_ids) - 1) // manifest.block_size)
    if usable <= 0:
        return 0
    own = token_chain(token_ids, manifest.block_size, usable)
    return usable if own == manifest.chain[:usable] else 0


def _model_fingerprint(model: str, revision: str | None) -> str:
    """A local model folder by its config and weight files; a hub model by name and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return f"{model}@{revision or 'main'}"
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size};".encode())
    return digest.hexdigest()


def _device_kind(specs: list[Any]) -> str:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
        return f"{current_platform.device_type}:{name}"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isas = {_get_attn_isa(s.dtype, s.block_size, getattr(s, "head_size", None)) for s in specs}
    return "cpu:" + ",".join(sorted(isas))


def _spec_fields(spec: Any) -> dict[str, str]:
    names = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window")
    return {n: str(getattr(spec, n)) for n in names if hasattr(spec, n)}


def engine_signature(vllm_config: Any, kv_cache_config: Any) -> tuple[str, dict[str, Any]]:
    """The signature's digest and what it was made of (for logs and the docs)."""
    model = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    parts = {
        "format": FORMAT_VERSION,
        "model": _model_fingerprint(model.model, getattr(model, "revision", None)),
        "kv_dtype": vllm_config.cache_config.cache_dtype,
        "block_size": vllm_config.cache_config.block_size,
        "tensor_parallel": vllm_config.parallel_config.tensor_parallel_size,
        "device": _device_kind([g.kv_cache_spec for g in groups]),
        "groups": [
            {
                "type": type(g.kv_cache_spec).__name__,
                "layers": list(g.layer_names),
                **_spec_fields(g.kv_cache_spec),
            }
            for g in groups
        ],
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return digest, parts
