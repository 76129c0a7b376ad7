"""How long a document `wim eval` may give a model: the worst-case WiM job must fit the window."""

from __future__ import annotations

import math

from wim_service.wim.options import WiMOptions

# Prompt tokens around the document (system prompt, tags, final instruction, query).
PROMPT_RESERVE = 256


def largest_length(max_model_len: int, options: WiMOptions) -> int:
    """The longest document (a multiple of 256 tokens) whose worst-case WiM job fits the window:
    document, prompts, one margin per segment (segments may run 25% short) and the answer."""
    per_margin = options.margin_max_tokens + 16
    length = max_model_len
    while length > 256:
        segments = math.ceil(length / (0.75 * options.segment_tokens)) + 1
        need = length + PROMPT_RESERVE + segments * per_margin + options.answer_max_tokens
        if need <= max_model_len:
            return length
        length -= 256
    raise SystemExit(f"wim eval: a {max_model_len}-token window leaves no room for a document")
