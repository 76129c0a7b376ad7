"""Turn templates + user text into token ids, rendering the model's chat template once per shape.

Templates are filled with *sentinels* in place of user text, and each chat turn's content is
wrapped in turn markers; the model's chat template renders the turns, and the result is split
at the markers and sentinels. Only the chat template's own scaffolding (turn openers, roles,
turn ends) is tokenized with special tokens recognised; template wording and user text are
tokenized with special-token strings kept literal, so neither a document nor a client's
`options.prompts` can open or close a chat turn. (`Tokenizer.template_special_tokens`, an
operator setting, lets template wording use control tokens.) User text never passes through
`str.format`, Jinja or the special-token parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from wim_service.wim.options import PLACEHOLDER, PromptTemplates, RelevanceMode
from wim_service.wim.tokenizer import Tokenizer

# Private-use code points (refused in templates, see `options.PRIVATE_USE`): clean split marks.
# A placeholder's value (user text) ...
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\w+)\ue001")
# ... and the content of a chat turn (template wording with sentinels in it).
_TURN_OPEN, _TURN_CLOSE = "\ue002", "\ue003"
_TURN_RE = re.compile("([\ue002\ue003])")


class TemplateError(ValueError):
    """Prompt templates that cannot work with this model's chat template (the client's to fix;
    its message is shown to the client, unlike other errors of the tokenizer)."""


def fill(template: str, values: Mapping[str, str]) -> str:
    """Replace `{name}` placeholders in one pass; inserted values are never scanned again."""
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def _sentinel(name: str) -> str:
    return _SENTINEL.format(name)


@dataclass(frozen=True)
class MarginNote:
    """A margin as the final prompt shows it."""

    segment: int  # 0-based; shown 1-based
    text: str
    rank: float = 0.0  # higher is more relevant: kept first when the window is short


class PromptBuilder:
    """Token ids of every prompt shape a job needs, for one tokenizer and one set of templates."""

    def __init__(self, tokenizer: Tokenizer, templates: PromptTemplates) -> None:
        self.tokenizer = tokenizer
        self.templates = templates

    def _chat(self, user_turn: str) -> str:
        return self.tokenizer.render_chat(
            [
                {"role": "system", "content": _TURN_OPEN + self.templates.system + _TURN_CLOSE},
                {"role": "user", "content": _TURN_OPEN + user_turn + _TURN_CLOSE},
            ]
        )

    def _tokenize(
        self, rendered: str, values: Mapping[str, str], *, in_turn: bool = False
    ) -> list[int]:
        """Tokenize rendered chat text: the chat template's scaffolding with special tokens,
        turn contents as wording and user text. `in_turn`: `rendered` starts inside a turn."""
        ids: list[int] = []
        for piece in _TURN_RE.split(rendered):
            if piece in (_TURN_OPEN, _TURN_CLOSE):
                in_turn = piece == _TURN_OPEN
            elif piece and in_turn:
                ids.extend(self._turn_content(piece, values))
            elif piece:
                ids.extend(self.tokenizer.encode_template_text(piece))
        return ids

    def _turn_content(self, text: str, values: Mapping[str, str]) -> list[int]:
        """Template wording, with each sentinel replaced by the tokens of its user text."""
        ids: list[int] = []
        for index, piece in enumerate(_SENTINEL_RE.split(text)):
            if index % 2:
                ids.extend(self.tokenizer.encode_user_text(values[piece]).ids)
            elif piece and self.tokenizer.template_special_tokens:
                ids.extend(self.tokenizer.encode_template_text(piece))
            elif piece:
                ids.extend(self.tokenizer.encode_user_text(piece).ids)
        return ids

    def _document_turn(
        self, instruction: str, values: Mapping[str, str]
    ) -> tuple[list[int], list[int]]:
        """(ids before the document, ids after it) of the document turn ending in `instruction`."""
        user_turn = fill(
            self.templates.document,
            {"document": _sentinel("document"), "instruction": instruction},
        )
        before, marker, after = self._chat(user_turn).partition(_sentinel("document"))
        if not marker or _sentinel("document") in after:
            raise TemplateError("the document template must place {document} exactly once")
        # The document sits inside the user turn: `after` starts in it.
        return self._tokenize(before, {}), self._tokenize(after, values, in_turn=True)

    @cached_property
    def context_prefix(self) -> list[int]:
        """Everything before the document's first token: shared by every request of a job."""
        return self._document_turn("", {})[0]

    def margin_suffix(self, query: str, relevance: RelevanceMode) -> list[int]:
        """What follows `document[:end]` in the margin request of a segment ending at `end`."""
        template = (
            self.templates.margin_first_token
            if relevance is RelevanceMode.FIRST_TOKEN
            else self.templates.margin
        )
        instruction = fill(template, {"query": _sentinel("query")})
        return self._checked_suffix(instruction, {"query": query})

    def final_suffix(self, query: str, margins: list[MarginNote]) -> list[int]:
        """What follows the whole document in the final-answer request."""
        values: dict[str, str] = {"query": query}
        entries = []
        for n, note in enumerate(margins):
            values[f"m{n}"] = note.text
            entries.append(
                fill(
                    self.templates.margin_entry,
                    {"segment": str(note.segment + 1), "text": _sentinel(f"m{n}")},
                )
            )
        listing = "\n".join(entries) if entries else self.templates.no_margins
        instruction = fill(self.templates.final, {"margins": listing, "query": _sentinel("query")})
        return self._checked_suffix(instruction, values)

    def final_suffix_within(
        self, query: str, notes: list[MarginNote], budget_tokens: int
    ) -> tuple[list[int], list[MarginNote]]:
        """The final suffix with as many notes as `budget_tokens` holds, and the notes it holds.

        Notes are admitted most relevant first (then earlier first), each only if the suffix
        still fits, and shown in document order. With no room for any note the suffix is the
        plain prompt's, even if that alone exceeds the budget: the window check is the caller's.
        """
        chosen: list[MarginNote] = []
        suffix = self.final_suffix(query, [])
        for note in sorted(notes, key=lambda n: (-n.rank, n.segment)):
            trial = sorted([*chosen, note], key=lambda n: n.segment)
            ids = self.final_suffix(query, trial)
            if len(ids) <= budget_tokens:
                chosen, suffix = trial, ids
        return suffix, chosen

    def plain_prompt(self, document_ids: list[int], query: str) -> list[int]:
        """Plain long-context inference: the whole document, then the final step without notes."""
        return self.context_prefix + document_ids + self.final_suffix(query, [])

    def classifier_prompt(self, query: str, margin: str) -> list[int]:
        """The stand-alone judging turn of relevance mode `classifier`."""
        user_turn = fill(
            self.templates.classifier,
            {"query": _sentinel("query"), "margin": _sentinel("margin")},
        )
        return self._tokenize(self._chat(user_turn), {"query": query, "margin": margin})

    def _checked_suffix(self, instruction: str, values: Mapping[str, str]) -> list[int]:
        before, after = self._document_turn(instruction, values)
        # The KV of a job is shared across margin and final requests only if every request
        # starts with exactly the same tokens; a chat template that varies them breaks WiM.
        if before != self.context_prefix:
            raise TemplateError("the chat template renders a different prefix for different steps")
        return after

    def margin_entry_overhead(self) -> int:
        """Tokens a margin entry adds around its text in the final prompt (upper estimate)."""
        entry = fill(self.templates.margin_entry, {"segment": "9999", "text": ""})
        return len(self.tokenizer.encode_user_text(entry + "\n").ids) + 2

    def relevance_token_ids(self) -> tuple[frozenset[int], frozenset[int]]:
        """First-token ids that mean YES and NO (with and without a leading space)."""

        def first_tokens(word: str) -> frozenset[int]:
            return frozenset(
                self.tokenizer.encode_user_text(variant).ids[0] for variant in (word, " " + word)
            )

        yes, no = first_tokens(self.templates.yes), first_tokens(self.templates.no)
        if yes & no:
            raise TemplateError("the YES and NO words start with the same token")
        return yes, no
