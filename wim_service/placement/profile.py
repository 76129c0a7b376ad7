"""What an engine's work costs in seconds: a profile measured on real engine runs.

Both the expected-wait policy (live) and the simulator's engines read the same profile, so
that the simulator replays what the policy believes. `wim calibrate` measures one; the
profile measured on the development machine ships as `profiles/default.json`.

Every number of a profile is finite and bounded, the bounds orders of magnitude above any
engine's (a step's fixed cost at most 600 s, a token's at most 60 s, a token of context's at
most 1 s; KV at most 10^9 tokens; token counts at most 10^6), so that no cost the simulator or
the router sums overflows to `inf` or `nan`; the file is at most `MAX_PROFILE_CHARS`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_PROFILE = "default.json"
MAX_PROFILE_CHARS = 1_000_000  # far above a calibrated profile, its samples included
MAX_TOKENS = 1_000_000

# Costs in seconds: finite, and bounded orders of magnitude above any engine's (the shipped
# profile's), so that sums over a long trace stay finite.
FixedCost = Annotated[float, Field(ge=0, le=600, allow_inf_nan=False)]
TokenCost = Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)]
ContextCost = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Measured = Annotated[float, Field(allow_inf_nan=False)]


Count = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class ProfileError(ValueError):
    """A profile that cannot be read, in one line naming its file and its first bad field."""


class PrefillCost(BaseModel):
    """Prefilling `new` tokens after `cached` ones: a fixed step cost, a cost per token, and
    attention's cost per token per token of context before it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed_s: FixedCost
    per_token_s: Annotated[TokenCost, Field(gt=0)]
    per_token_context_s: ContextCost

    def seconds(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        mean_context = cached + new / 2
        return self.fixed_s + new * (self.per_token_s + self.per_token_context_s * mean_context)


class DecodeCost(BaseModel):
    """One decode step of a batch: a fixed cost, a cost per sequence, and one per token of
    context the batch attends to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed_s: FixedCost
    per_sequence_s: TokenCost
    per_context_token_s: ContextCost

    def step_seconds(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return (
            self.fixed_s + batch * self.per_sequence_s + context_tokens * self.per_context_token_s
        )


class RestoreCost(BaseModel):
    """Restoring a document's saved KV from the KV store into a new context
    (docs/kv-store.md): a fixed cost (the manifest's check, one engine step, the tail of at
    most a block and a token computed) and a cost per token of the document (its blocks read,
    opened and copied in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed_s: FixedCost
    per_token_s: TokenCost

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.per_token_s if tokens > 0 else 0.0


# -- the measurements a profile's costs were fitted to: one type per kind, told apart by `kind`


class _Sample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: Measured


class PrefillSample(_Sample):
    """The first token of one request: `new` tokens prefilled after `cached` ones the prefix
    cache served."""

    kind: Literal["prefill"] = "prefill"
    new: Count
    cached: Count


class DecodeSample(_Sample):
    """One decode step (`seconds`, averaged over `steps`) of `batch` sequences that attend to
    `context` tokens in all."""

    kind: Literal["decode"] = "decode"
    batch: Count
    context: Measured
    steps: Count


class QuerySample(_Sample):
    """A WiM query on a read document of `document` tokens, alone on its engine: seconds to
    its answer's first text, with the `margins` it wrote (`margin_tokens` each on average)."""

    kind: Literal["query"] = "query"
    document: Count
    query: Count
    margins: Count
    margin_tokens: Measured


class RestoreSample(_Sample):
    """A restore of a saved document of `tokens` tokens (`computed` of them computed, not
    restored), with when and under what load: a restore-only calibration adds these to a
    profile measured at another time."""

    kind: Literal["restore"] = "restore"
    tokens: Count
    computed: Count
    unix_time: Measured
    load_1min: Measured


Sample = Annotated[
    PrefillSample | DecodeSample | QuerySample | RestoreSample, Field(discriminator="kind")
]


class EngineProfile(BaseModel):
    """An engine's costs and sizes, with where and how they were measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(1, ge=1, le=1)
    model: str
    dtype: str
    machine: str
    measured_at: str
    load_average: tuple[Measured, Measured, Measured]
    block_tokens: int = Field(gt=0, le=65_536)
    kv_capacity_tokens: int = Field(gt=0, le=10**9)
    max_batch: int = Field(gt=0, le=65_536)
    # What a margin adds to its segment's KV besides its own output (instruction and query).
    margin_prompt_tokens: int = Field(ge=0, le=MAX_TOKENS)
    prefill: PrefillCost
    decode: DecodeCost
    # Tokens a WiM query that writes margins prefills after its document besides its margins'
    # prompts and its answer's query and notes (`lone_query_seconds`): the answers WiM starts
    # beside its last margins (`answer_early`), one per guess at the notes, whose prefills
    # attend to the whole document and pause the margins' decode. Fitted to real queries by
    # calibration; 0 in a profile measured before that.
    query_extra_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    # What a copy or a rebuild of a document already read costs when the service has a KV
    # store and restores it (`read_seconds`); None in a profile measured before restores
    # were, or for a service without a store (`for_store`): such a copy is charged a re-read.
    restore: RestoreCost | None = None
    # The measurements the costs were fitted to (calibration's), kept so that a fit can be
    # checked and refitted.
    samples: list[Sample] = Field(default_factory=list)

    @classmethod
    def load(cls, path: Path | None = None) -> EngineProfile:
        """The profile in `path`, or the one shipped with the project. A file out of bounds
        or not a profile is a `ProfileError` (OSError if it cannot be read)."""
        if path is None:
            text = resources.files(__package__).joinpath("profiles", DEFAULT_PROFILE).read_text()
        else:
            with Path(path).open(encoding="utf-8") as file:
                text = file.read(MAX_PROFILE_CHARS + 1)  # never a whole huge file
            if len(text) > MAX_PROFILE_CHARS:
                raise ProfileError(f"profile {path}: larger than {MAX_PROFILE_CHARS:,} characters")
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise ProfileError(f"profile {path or DEFAULT_PROFILE}: {first_error(exc)}") from None

    def with_kv_capacity(self, tokens: int) -> EngineProfile:
        """The profile with `tokens` of KV per replica, validated as a loaded one is."""
        try:
            return self.model_validate(self.model_dump() | {"kv_capacity_tokens": tokens})
        except ValidationError as exc:
            raise ProfileError(f"KV capacity: {first_error(exc)}") from None

    def for_store(self, restores: bool) -> EngineProfile:
        """The profile a service charges its copies by: with `restores` off (no KV store, or
        placement told not to count on it) a copy is charged a re-read of its document."""
        return self if restores else self.model_copy(update={"restore": None})

    def read_seconds(self, document_tokens: int, *, saved: bool) -> float:
        """What putting a document's KV on an engine costs: restoring it when it was saved
        (`saved`: a copy or a rebuild of a document read before, never a first read) and the
        profile has a restore cost, else prefilling the whole document. The live placement,
        the replicas' backlogs and `wim sim` all charge a copy here."""
        if saved and self.restore is not None:
            return self.restore.seconds(document_tokens)
        return self.prefill.seconds(document_tokens)

    def dtype_mismatch(self, dtype: str) -> str | None:
        """Why this profile does not describe engines that run `dtype`, or None if it was
        measured in it: a dtype moves an engine's speed severalfold on a CPU, even where both
        are native (docs/routing.md)."""
        if self.dtype == dtype:
            return None
        return f"the engine profile was measured in {self.dtype}, the engines run {dtype}"

    def decode_seconds(self, tokens: int, batch: int, context_tokens: int) -> float:
        """`tokens` decode steps at a steady `batch` over `context_tokens` of KV."""
        return tokens * self.decode.step_seconds(max(1, batch), context_tokens)

    # -- a WiM query on a read document, step by step (the simulator queues each step) ----

    def margins_prefill_seconds(self, margins: int, document_tokens: int) -> float:
        """The prompts of `margins` margins, prefilled together after the document's KV."""
        return self.prefill.seconds(margins * self.margin_prompt_tokens, cached=document_tokens)

    def answer_prefill_seconds(
        self, query_tokens: int, margins: int, margin_tokens: int, document_tokens: int
    ) -> float:
        """The query and its margins' notes after the document's KV, and when margins were
        written the answers started beside them (`query_extra_tokens`)."""
        new = query_tokens + margins * margin_tokens
        if margins:
            new += self.query_extra_tokens
        return self.prefill.seconds(new, cached=document_tokens)

    def lone_query_seconds(
        self, document_tokens: int, query_tokens: int, margins: int, margin_tokens: int
    ) -> float:
        """Seconds to a WiM query's first answer token on a read document, alone on its
        engine: its margins' prompts, their other tokens decoded side by side (the first
        comes with the prefill), then the answer's prefill."""
        seconds = self.answer_prefill_seconds(query_tokens, margins, margin_tokens, document_tokens)
        if margins:
            seconds += self.margins_prefill_seconds(margins, document_tokens)
            steps = margin_tokens - 1
            context = margins * (document_tokens + self.margin_prompt_tokens + margin_tokens / 2)
            seconds += self.decode_seconds(steps, margins, round(context))
        return seconds


def first_error(exc: ValidationError) -> str:
    """A validation error in one line: where its first error is, what, and the value."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the profile"
    value = repr(error["input"])
    if len(value) > 40:
        value = f"{value[:30]}... ({len(value):,} characters)"
    more = exc.error_count() - 1
    return f"{where}: {error['msg']}, not {value}" + (f" (and {more} more)" if more else "")
