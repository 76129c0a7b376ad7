"""Margins: one request per segment, written over the context up to that segment's end.

A `MarginWriter` writes the margins of one query. Each margin is watched while it is written
(`_MarginWatch`): its YES/NO first token, its draft (which early answers read), and whether it
can still be kept (the note policy's forecasts); once it ends, the note policy judges it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from wim_service.wim.backend import GenerationParams, RequestKind
from wim_service.wim.events import MarginEvent
from wim_service.wim.grounding import SegmentText
from wim_service.wim.options import RelevanceMode
from wim_service.wim.pinned import PinnedDocument
from wim_service.wim.prompts import MarginNote
from wim_service.wim.query import QueryRun
from wim_service.wim.segmentation import Segment, leading_sentences
from wim_service.wim.streams import Generated, consume


def strip_relevance_word(text: str, word: str) -> str:
    """`text` without the relevance word it opens with (and the punctuation after it)."""
    body = text.lstrip()
    if body.upper().startswith(word.upper()):
        body = body[len(word) :]
    return body.lstrip(" \t\n:#-,.;")


@dataclass
class _MarginWatch:
    """One margin while it is written: its verdict, its draft, whether it was cut short."""

    writer: MarginWriter
    segment: int
    segment_text: SegmentText
    said_yes: bool | None = None  # its first token, in `first_token` relevance mode
    cut_short: bool = False  # stopped because no continuation could be kept

    def keep_going(self, token: int) -> bool:
        """Called on the first token: a NO margin ends there."""
        self.said_yes = token in self.writer.document.yes_ids
        return self.said_yes

    def give_up(self, text: str) -> bool:
        """Whether the margin may stop: its sentences are written, or it cannot be kept."""
        run = self.writer.run
        body = self.writer.written(text)
        # Early answers read the draft, to tell whether the note they assume is still coming.
        run.drafts[self.segment] = body
        max_sentences = run.options.margin_max_sentences
        if max_sentences and leading_sentences(body, max_sentences):
            return True
        # Grounding or the query filter will drop it whatever follows; stop paying for it.
        self.cut_short = run.policy.cannot_keep(self.segment_text, body, run.query)
        return self.cut_short


class MarginWriter:
    """Writes (and judges) the margins of one query over one pinned document."""

    def __init__(self, document: PinnedDocument, run: QueryRun) -> None:
        self.document = document
        self.run = run
        self.suffix = document.builder.margin_suffix(run.query, run.options.relevance)
        self.first_token = run.options.relevance is RelevanceMode.FIRST_TOKEN

    def skips(self, segment: Segment) -> bool:
        """Whether no margin of `segment` could be kept, so that none is written."""
        segment_text = self.document.segment_texts[segment.index]
        return self.run.policy.none_can_be_kept(segment_text, self.run.query)

    def written(self, text: str) -> str:
        """The margin as `ground` will see it: a first-token margin without its YES."""
        if not self.first_token:
            return text
        return strip_relevance_word(text, self.document.builder.templates.yes)

    async def write(self, segment: Segment) -> MarginNote | None:
        """Write (and judge) the margin of `segment`; returns its note if it is kept."""
        run = self.run
        if self.skips(segment):
            run.emit(
                MarginEvent(
                    segment=segment.index,
                    text="",
                    relevant=False,
                    skipped=True,
                    char_start=segment.char_start,
                    char_end=segment.char_end,
                    elapsed_s=0.0,
                )
            )
            return None
        submitted = time.perf_counter()
        segment_text = self.document.segment_texts[segment.index]
        watch = _MarginWatch(self, segment.index, segment_text)
        generated = await self._generate(segment, watch)
        text = generated.text.strip()
        if self.first_token:
            text = self.written(text) if watch.said_yes else ""
        if run.options.margin_max_sentences:
            # The token that began the next sentence is not part of the margin.
            text = leading_sentences(text, run.options.margin_max_sentences) or text
        relevant = await self._relevant(text, watch)
        verdict = run.policy.judge(segment_text, run.query, text, relevant=relevant)
        evidence = verdict.evidence
        run.emit(
            MarginEvent(
                segment=segment.index,
                text=text,
                relevant=relevant,
                grounded=verdict.grounding.grounded,
                cut_short=watch.cut_short,
                kept=verdict.kept,
                evidence=evidence.text if evidence else "",
                evidence_start=evidence.char_start if evidence else None,
                evidence_end=evidence.char_end if evidence else None,
                char_start=segment.char_start,
                char_end=segment.char_end,
                elapsed_s=time.perf_counter() - submitted,
            )
        )
        return verdict.note_of(segment.index)

    async def _generate(self, segment: Segment, watch: _MarginWatch) -> Generated:
        """The margin request, a branch over the context up to the end of `segment`."""
        document, options = self.document, self.run.options
        params = GenerationParams(
            kind=RequestKind.MARGIN,
            max_tokens=options.margin_max_tokens,
            stop_token_ids=document.stop_ids(options),
            first_token_ids=(document.yes_ids | document.no_ids) if self.first_token else None,
        )
        prefix_tokens = len(document.plan.prefix_ids) + segment.token_end
        try:
            generated = await consume(
                document.context.branch(prefix_tokens, self.suffix, params),
                document.builder.tokenizer,
                stop=options.margin_stop,
                keep_going=watch.keep_going if self.first_token else None,
                give_up=watch.give_up,
            )
        finally:
            self.run.drafts.pop(segment.index, None)
        self.run.ledger.add(generated.cost, minimal=len(self.suffix))
        self.run.ledger.margin_tokens += len(generated.token_ids)
        return generated

    async def _relevant(self, text: str, watch: _MarginWatch) -> bool:
        """The relevance mode's verdict on a finished margin (an empty one never is)."""
        relevance = self.run.options.relevance
        if self.first_token:
            relevant = bool(watch.said_yes)
        elif relevance is RelevanceMode.CLASSIFIER:
            # A cut-short margin is dropped whatever the verdict: no request to judge it.
            relevant = not watch.cut_short and await self._classify(text)
        else:
            relevant = True
        return relevant and bool(text)

    async def _classify(self, margin: str) -> bool:
        """The classifier turn: a one-token YES/NO on a finished margin."""
        if not margin:
            return False
        document, run = self.document, self.run
        prompt = document.builder.classifier_prompt(run.query, margin)
        params = GenerationParams(
            kind=RequestKind.CLASSIFIER,
            max_tokens=1,
            stop_token_ids=document.stop_ids(run.options),
            first_token_ids=document.yes_ids | document.no_ids,
        )
        generated = await consume(
            document.context.generate(prompt, params), document.builder.tokenizer, stop=[]
        )
        run.ledger.add(generated.cost, minimal=len(prompt))
        run.ledger.margin_tokens += len(generated.token_ids)
        return bool(generated.token_ids) and generated.token_ids[0] in document.yes_ids
