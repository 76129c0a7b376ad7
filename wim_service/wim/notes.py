"""Which margins become notes: the keep rule, and every forecast the job makes of it.

A margin's note is kept if the margin was judged relevant, its own segment grounds it (unless
grounding is off) and the note holds enough of the query (`NotePolicy.clears_query_filter`).
The job forecasts that rule to spare engine work: a segment none of whose margins could be
kept is skipped, a margin that can no longer be kept is cut short, and an early answer assumes
the note a running margin is expected to give while its draft may still give it. Each forecast
asks the rule here instead of restating it, so that changing the rule (its query threshold
above all) is one edit and no forecast can disagree with the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from wim_service.wim.grounding import (
    Evidence,
    Grounding,
    SegmentText,
    may_still_copy,
    query_overlap,
)
from wim_service.wim.options import GroundingMode, WiMOptions
from wim_service.wim.prompts import MarginNote


@dataclass(frozen=True)
class Verdict:
    """What the keep rule made of one finished margin."""

    grounding: Grounding
    note: str  # what the final prompt would read: the evidence, when snapped, else the margin
    overlap: float  # the share of the query the note holds; ranks kept notes
    kept: bool

    @property
    def evidence(self) -> Evidence | None:
        """The segment's words that ground the margin (None if it is not grounded)."""
        return self.grounding.evidence if self.grounding.grounded else None

    def note_of(self, segment: int) -> MarginNote | None:
        return MarginNote(segment, self.note, rank=self.overlap) if self.kept else None


@dataclass(frozen=True)
class NotePolicy:
    """The keep rule of one query's options, and the forecasts of it."""

    grounding: GroundingMode
    min_query_overlap: float  # the keep threshold: the share of the query a note must hold
    min_coverage: float  # of a margin's claim, found in its evidence
    max_sentences: int  # in one evidence window
    skip_unmatched: bool  # whether a segment that can keep no note is skipped

    @classmethod
    def of(cls, options: WiMOptions) -> NotePolicy:
        return cls(
            grounding=options.grounding,
            min_query_overlap=options.note_min_query_overlap,
            min_coverage=options.grounding_min_coverage,
            max_sentences=options.grounding_max_sentences,
            skip_unmatched=options.skip_unmatched_segments,
        )

    # -- the rule --------------------------------------------------------------------------

    def clears_query_filter(self, overlap: float) -> bool:
        """Whether a note holding `overlap` of the query holds enough of it to be kept."""
        return overlap >= self.min_query_overlap

    def evidence_clears(self, overlap: float) -> bool:
        """Whether evidence holding `overlap` of the query allows its margin's note to be kept:
        with snapping the note is the evidence, so the query filter reads it; otherwise the
        filter reads the margin's own words, which evidence does not bound."""
        return self.grounding is not GroundingMode.SNAP or self.clears_query_filter(overlap)

    def judge(
        self, segment_text: SegmentText, query: str, margin: str, *, relevant: bool
    ) -> Verdict:
        """Ground a finished margin in its segment and decide whether its note is kept."""
        grounding = segment_text.ground(
            margin, min_coverage=self.min_coverage, max_sentences=self.max_sentences
        )
        evidence = grounding.evidence if grounding.grounded else None
        snapped = self.grounding is GroundingMode.SNAP
        note = evidence.text if evidence is not None and snapped else margin
        overlap = query_overlap(query, note)
        kept = (
            relevant
            and (grounding.grounded or self.grounding is GroundingMode.OFF)
            and self.clears_query_filter(overlap)
        )
        return Verdict(grounding, note, overlap, kept)

    # -- its forecasts ---------------------------------------------------------------------

    def none_can_be_kept(self, segment_text: SegmentText, query: str) -> bool:
        """Whether every margin of this segment would fall to the query filter: with snapping,
        a note is one of the segment's sentence windows, and none shares enough of the query.
        (Asked only when the filter can refuse anything: scoring windows is not free.)"""
        if not self.skip_unmatched or self.grounding is not GroundingMode.SNAP:
            return False
        if self.clears_query_filter(0.0):  # the filter refuses no note
            return False
        best = segment_text.best_query_overlap(query, self.max_sentences)
        return not self.clears_query_filter(best)

    def cannot_keep(self, segment_text: SegmentText, draft: str, query: str) -> bool:
        """Whether grounding or the query filter will refuse the margin whatever follows
        `draft`, the start of it written so far (see `SegmentText.cannot_keep`)."""
        return self.grounding is not GroundingMode.OFF and segment_text.cannot_keep(
            draft,
            query,
            max_sentences=self.max_sentences,
            clears=self.evidence_clears,
        )

    def expected_note(self, segment_text: SegmentText, query: str, draft: str) -> MarginNote | None:
        """The note a running margin gives if it copies its segment's sentence closest to the
        query, as the instruction asks (snapping only: otherwise a note is the margin's own
        words, which cannot be foreseen), unless `draft`, what it has written so far, strays
        from that sentence. A wrong guess costs the early answer, not its correctness: it
        stands only if its final prompt is the one the actual notes make."""
        if self.grounding is not GroundingMode.SNAP:
            return None
        text, overlap = segment_text.closest_sentence(query)
        if not text or not self.clears_query_filter(overlap):
            return None
        if not self.may_still_give(draft, text):
            return None
        return MarginNote(segment_text.segment.index, text, rank=overlap)

    def may_still_give(self, draft: str, note: str) -> bool:
        """Whether a margin that has written `draft` so far may still be grounded by `note`
        (a margin not running has no draft, "", and may)."""
        return may_still_copy(draft, note, min_coverage=self.min_coverage)
