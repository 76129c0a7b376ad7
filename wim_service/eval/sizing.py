"""How long a document `wim eval` may give a model: every request of a WiM job on it must fit
the window, as the capacity model (`wim/capacity.py`) counts it."""

from __future__ import annotations

from wim_service.wim.capacity import largest_document
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.tokenizer import Tokenizer

# Task lengths are whole multiples of this many tokens.
LENGTH_STEP = 256


class WindowTooSmall(ValueError):
    """The model's window leaves no room for a document `wim eval` asks about (any, or one of
    the lengths asked for)."""


def largest_length(max_model_len: int, options: WiMOptions, tokenizer: Tokenizer) -> int:
    """The longest document (a multiple of 256 tokens) that a WiM job with `options` reads in a
    `max_model_len` window, with room for a query of the capacity model's reserved size."""
    builder = PromptBuilder(tokenizer, options.prompts)
    longest = largest_document(builder, options, max_model_len) // LENGTH_STEP * LENGTH_STEP
    if longest <= 0:
        raise WindowTooSmall(f"a {max_model_len}-token window leaves no room for a document")
    return longest
