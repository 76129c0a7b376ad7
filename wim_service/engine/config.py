"""Engine settings, validated once at the edge (CLI, serve config, tests).

`EngineConfig` is also the single source of the engine's command-line flags: `add_cli_args`
derives each flag's type, default and help from the field, `from_cli_args` reads them back
(the shape of vLLM's `EngineArgs.add_cli_args` / `from_cli_args`).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo

from wim_service.wim.capacity import DEFAULT_SIDE_BY_SIDE_KV_RESERVE

Dtype = Literal["bfloat16", "float32", "float16", "auto"]
# CPU features that compute bfloat16 in hardware (Linux /proc/cpuinfo flag names). Without them
# PyTorch emulates bfloat16 matrix products, several times slower than float32 (the run that
# measured it: docs/deploy.md, "On one machine").
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


class EngineConfig(BaseModel):
    """One vLLM engine and its admission control."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        description="local Hugging Face model folder (default: the offline SmolLM2-135M-Instruct)",
    )
    dtype: Dtype = Field(
        "auto",
        description='model dtype; "auto": on a CPU bfloat16 only where it computes bfloat16 in '
        "hardware (AVX512-BF16 or AMX), float32 elsewhere; on a GPU the model's own dtype",
    )
    max_model_len: int = Field(
        8192, ge=256, description="context window in tokens (document, margins and answer)"
    )
    kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description="KV cache size in GiB. On CPU this is the whole KV pool; set it explicitly "
        "so that several engines can share a machine (vLLM would otherwise take 92% of RAM)",
    )
    block_size: int = Field(
        32,
        ge=16,
        description="KV block size in tokens; CPU kernels need a multiple of 32. Small blocks "
        "let more segment ends fall on a block boundary (a margin recomputes context tokens "
        "past its last full block)",
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=256,
        description="tokens per engine step; a large budget lets one step carry a whole "
        "segment's prefill together with the margins' decodes",
    )
    max_num_seqs: int = Field(
        128, ge=4, description="sequences per engine step (at least 2 x max_sessions)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of shared prompt prefixes across requests"
    )
    cpu_threads_bind: str = Field(
        "all",
        description='thread binding for the CPU worker: "all" (every core this process may '
        'use), "rank" (one core per engine replica, by its rank on the node), or vLLM\'s own '
        '"auto"/"nobind"/"0-1"',
    )
    enforce_eager: bool = Field(True, description="run the model eagerly, without graph capture")
    seed: int = Field(0, description="vLLM's sampling seed")
    max_sessions: int = Field(
        16, ge=1, description="admission control: how many documents may hold KV at once"
    )
    admission_timeout_s: float = Field(
        30.0,
        ge=0,
        description="admission control: how long a new job may wait for KV room before it is "
        "refused with OVERLOADED",
    )
    side_by_side_kv_reserve: float = Field(
        DEFAULT_SIDE_BY_SIDE_KV_RESERVE,
        ge=0,
        lt=1,
        description="a document session's query runs beside the one in its turn, in KV blocks "
        "of its own, only if this share of the engine's KV stays free after it (0: whenever "
        "the blocks are free); kept free, new sessions and plain requests find room when the "
        "fleet is full (docs/routing.md)",
    )
    zero_purged_blocks: bool = Field(
        True,
        description="overwrite a closed session's KV blocks with zeros when they are purged, so "
        "no document data stays in KV memory (its cost, measured: docs/security.md, "
        '"Data retention")',
    )
    kv_store: str | None = Field(
        None,
        description="where documents' KV is saved as they are read and restored from on "
        "another engine: a directory or a redis:// URL (default: env WIM_KV_STORE; unset: "
        "no stored KV). Needs env WIM_KV_MASTER_KEY (docs/kv-store.md)",
    )
    kv_store_max_gib: float | None = Field(
        None,
        gt=0,
        description="the KV store's bound in GiB; least recently used documents are evicted "
        "past it (default: env WIM_KV_STORE_MAX_GIB, else 8)",
    )
    template_special_tokens: bool = Field(
        False,
        description="let prompt templates sent by clients (options.prompts) contain the model's "
        "control tokens such as <|im_start|>; off, they are plain text and only the chat "
        "template itself opens and closes turns",
    )

    # Not flags: every request decodes greedily, so the seed changes nothing a user sees (and
    # `wim eval --seed` is the task generator's).
    CLI_EXCLUDED: ClassVar[frozenset[str]] = frozenset({"seed"})

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.block_size % 16:
            raise ValueError("block_size must be a multiple of 16 (32 on CPU)")
        if self.max_num_seqs < 2 * self.max_sessions:
            raise ValueError(
                "max_num_seqs must be at least 2 x max_sessions: every parked document holds "
                "a sequence slot, and its margins need slots too"
            )
        return self

    def cpu_dtype(self, flags: frozenset[str] | None = None) -> Dtype:
        """The dtype to run on this machine's CPU: `dtype`, with "auto" resolved by `flags`
        (the machine's own by default)."""
        if self.dtype != "auto":
            return self.dtype
        native = NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags)
        return "bfloat16" if native else "float32"

    def dtype_label(self) -> str:
        """`dtype` as a report shows it: "auto" with what it means on this machine's CPU."""
        return self.dtype if self.dtype != "auto" else f"auto ({self.cpu_dtype()} on a CPU)"

    @classmethod
    def cli_fields(cls) -> list[str]:
        return [name for name in cls.model_fields if name not in cls.CLI_EXCLUDED]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per settable field to an "engine" group of `parser`."""
        group = parser.add_argument_group("engine", cls.__doc__)
        for name in cls.cli_fields():
            group.add_argument("--" + name.replace("_", "-"), **_argparse_kwargs(cls, name))
        return parser

    def cli_argv(self) -> list[str]:
        """The `add_cli_args` flags that give this config: one per field set to other than its
        default (a report's command line that reproduces the run)."""
        argv: list[str] = []
        for name in self.cli_fields():
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value == type(self).model_fields[name].default:
                continue
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv.append(f"{flag} {shlex.quote(str(value))}")
        return argv

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config from `add_cli_args` flags; `overrides` win over what the user passed."""
        given = {name: getattr(args, name) for name in cls.cli_fields() if hasattr(args, name)}
        return cls(**{**given, **overrides})


def _argparse_kwargs(model: type[BaseModel], name: str) -> dict[str, Any]:
    field = model.model_fields[name]
    description = (field.description or "").replace("%", "%%")  # argparse formats help
    kinds = set(get_args(field.annotation)) if _is_union(field.annotation) else {field.annotation}
    kinds.discard(NoneType)
    (kind,) = kinds  # one type per flag (optional fields: that type or None)
    if field.default is not None:
        description += " (default: %(default)s)"
    kwargs: dict[str, Any] = {"default": field.default, "help": description}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag
        return kwargs
    if get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
    kwargs["type"] = _checked(name, field)
    return kwargs


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType)


def _checked(name: str, field: FieldInfo) -> Callable[[str], Any]:
    """Parse one flag's value with the field's own type and bounds: `--max-model-len 10` is an
    argparse error naming the flag, not a traceback."""
    checked: Any = (
        Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    )
    adapter: TypeAdapter[Any] = TypeAdapter(checked)

    def parse(text: str) -> Any:
        try:
            return adapter.validate_strings(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(exc.errors()[0]["msg"]) from exc

    parse.__name__ = name  # argparse names the type in some messages
    return parse
