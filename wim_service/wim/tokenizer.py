"""The tokenizer surface the algorithm needs, and its Hugging Face implementation."""

from __future__ import annotations

import copy
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
    # Token ids are 0 .. vocab_size - 1.
    vocab_size: int
    # An operator setting: template wording (`options.prompts`) may contain control tokens.
    # Off, only the chat template's own scaffolding does (see `wim.prompts`).
    template_special_tokens: bool

    def encode_user_text(self, text: str) -> EncodedText:
        """Tokenize untrusted text: special-token strings stay plain text, no BOS is added."""
        ...

    def encode_template_text(self, text: str) -> list[int]:
        """Tokenize the chat template's scaffolding: special-token strings are special tokens."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template with the assistant generation prompt appended."""
        ...


class HFTokenizer:
    """`Tokenizer` over a transformers fast tokenizer loaded from a local folder.

    Safe to call from several threads at once (documents are tokenized off the event loop).
    """

    def __init__(self, model_dir: str | Path, *, template_special_tokens: bool = False) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self._tok)
        self.template_special_tokens = template_special_tokens
        # transformers honours `split_special_tokens` by switching one flag on the shared Rust
        # tokenizer per call: two threads tokenizing at once would race on it (user text could
        # be tokenized with control tokens recognised). User text gets its own copy, flag fixed.
        self._user_tok: Any = copy.deepcopy(self._tok.backend_tokenizer)
        self._user_tok.encode_special_tokens = True
        # Whatever tokenizer.json says, a document is never truncated or padded.
        self._user_tok.no_truncation()
        self._user_tok.no_padding()
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
        # encode_batch releases the GIL while it runs (encode does not).
        (encoded,) = self._user_tok.encode_batch([text], add_special_tokens=False)
        # Both are new lists (of int tuples): building them holds the GIL, so build them once.
        return EncodedText(encoded.ids, encoded.offsets)

    def encode_template_text(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return str(
            self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
