"""The tokenizer surface the algorithm needs, and its Hugging Face implementation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class EncodedText:
    """Token ids of a piece of text and each token's character span in that text."""

    ids: list[int]
    offsets: list[tuple[int, int]]


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]

    def encode_user_text(self, text: str) -> EncodedText:
        """Tokenize untrusted text: special-token strings stay plain text, no BOS is added."""
        ...

    def encode_template_text(self, text: str) -> list[int]:
        """Tokenize our own rendered template text: special-token strings are special tokens."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template with the assistant generation prompt appended."""
        ...


class HFTokenizer:
    """`Tokenizer` over a transformers fast tokenizer loaded from a local folder."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
        eos: set[int] = set()
        if self._tok.eos_token_id is not None:
            eos.add(self._tok.eos_token_id)
        try:
            generation = GenerationConfig.from_pretrained(str(model_dir))
        except OSError:
            generation = None
        if generation is not None and generation.eos_token_id is not None:
            ids = generation.eos_token_id
            eos.update(ids if isinstance(ids, list) else [ids])
        self.eos_token_ids = frozenset(eos)

    def encode_user_text(self, text: str) -> EncodedText:
        encoded = self._tok(
            text,
            add_special_tokens=False,
            split_special_tokens=True,
            return_offsets_mapping=True,
        )
        return EncodedText(
            list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
        )

    def encode_template_text(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
