"""OpenAI requests as text: chat turns, the prompt the chat template makes of them, and the
document and query a long prompt holds (see `service.py`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from wim_service.assets.default_model import GGUF_FILE
from wim_service.engine.config import EngineConfig
from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.openai.models import ChatMessage
from wim_service.wim.tokenizer import Tokenizer

OPEN_DOCUMENT, CLOSE_DOCUMENT = "<document>", "</document>"
# Private-use code points around a turn's number: where the chat template put that turn's text.
_TURN_MARK = "\ue010{}\ue011"
_TURN_MARK_RE = re.compile("\ue010(\\d+)\ue011")


@dataclass(frozen=True)
class Turn:
    role: str  # system, user or assistant
    text: str


def chat_turns(messages: list[ChatMessage]) -> list[Turn]:
    turns = []
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if message.role in ("tool", "function"):
            raise ServiceError(
                ServiceCode.UNSUPPORTED, "tool messages are not supported", param=where
            )
        content = message.content
        if content is None:
            if message.role != "assistant":
                raise ServiceError(
                    ServiceCode.INVALID_REQUEST,
                    f"a {message.role} message needs content",
                    param=where,
                )
            content = ""
        if not isinstance(content, str):
            if any(part.type != "text" or part.text is None for part in content):
                raise ServiceError(
                    ServiceCode.UNSUPPORTED, "only text content is supported", param=where
                )
            content = "".join(part.text or "" for part in content)
        turns.append(Turn("system" if message.role == "developer" else message.role, content))
    if not any(turn.role == "user" for turn in turns):
        raise ServiceError(
            ServiceCode.INVALID_REQUEST, "the messages have no user turn", param="messages"
        )
    return turns


def chat_prompt_ids(tokenizer: Tokenizer, turns: list[Turn]) -> list[int]:
    """The model's chat template over `turns`, rendered with a marker in place of each turn's
    text. Only the template's own text is tokenized with special tokens recognised; the turns'
    text is tokenized as text (`<|im_end|>` typed by a client stays text), as in `wim.prompts`.
    """
    rendered = tokenizer.render_chat(
        [{"role": turn.role, "content": _TURN_MARK.format(i)} for i, turn in enumerate(turns)]
    )
    pieces = _TURN_MARK_RE.split(rendered)
    if sorted(int(p) for p in pieces[1::2]) != list(range(len(turns))):
        raise ServiceError(
            ServiceCode.INVALID_REQUEST,
            "the model's chat template cannot render these messages",
            param="messages",
        )
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids += tokenizer.encode_user_text(turns[int(piece)].text).ids
        elif piece:
            ids += tokenizer.encode_template_text(piece)
    return ids


def split_document(text: str) -> tuple[str, str]:
    """(the text between `<document>` delimiters, the rest of `text`).

    One left-to-right scan, linear in the text: it runs on the router's event loop, where a
    backtracking regex was quadratic on repeated openings (seconds for a long run of them).
    Each opening pairs with the first closing after it; an opening without one is text.
    """
    blocks: list[str] = []
    rest: list[str] = []
    at = 0
    while (start := text.find(OPEN_DOCUMENT, at)) >= 0:
        end = text.find(CLOSE_DOCUMENT, start + len(OPEN_DOCUMENT))
        if end < 0:
            break
        blocks.append(text[start + len(OPEN_DOCUMENT) : end].strip())
        rest.append(text[at:start])
        at = end + len(CLOSE_DOCUMENT)
    rest.append(text[at:])
    return "\n\n".join(blocks), " ".join(rest).strip()


def document_and_query(turns: list[Turn]) -> tuple[str, str]:
    """The document and the query of a chat (see the module's docstring)."""
    users = [turn.text for turn in turns if turn.role == "user"]
    document, query = split_document(users[-1])
    if not document:
        document = "\n\n".join(split_document(text)[0] or text for text in users[:-1])
    return document, query


def served_model_name(engine: EngineConfig) -> str:
    return Path(engine.model).name if engine.model else GGUF_FILE.partition(".")[0]
