"""One simulated replica: a vLLM engine with continuous batching, timed by an `EngineProfile`.

The engine does one thing at a time, as a CPU engine does: a prefill (one at a time, in the
order submitted, costing `profile.prefill.seconds(new, cached)` for the tokens not served from
its cache), or a run of decode steps of the whole running batch, each costing
`profile.decode.step_seconds(batch, context)`. A prefill waits for the decode step under way,
then pauses the batch (no chunked-prefill overlap: pessimistic for decode, true to the wait a
queued prefill sees).

It is event driven: between two changes of the batch (a sequence ends, a prefill arrives) the
steps' costs sum in closed form, so one heap event covers many steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from wim_service.placement.backlog import Backlog
from wim_service.placement.ledger import LoadReport
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import PrefixCache
from wim_service.sim.traces import MOONCAKE_BLOCK_TOKENS
from wim_service.wim.capacity import kept_free_blocks


class Prefill(Protocol):
    """A prefill queued on an engine, for its owner."""

    @property
    def job(self) -> Owner: ...

    def begin(self, engine: Engine) -> float:
        """Seconds the prefill takes, decided when it starts (its cache hit is known then)."""
        ...

    def finish(self, engine: Engine, now: float) -> None: ...


class Owner(Protocol):
    def decoded(self, engine: Engine, now: float) -> None:
        """One of the owner's sequences decoded its last token at `now`."""
        ...


@dataclass(eq=False, slots=True)
class Sequence:
    owner: Owner
    remaining: int  # decode steps left
    context: int  # tokens the next step attends to


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Steps of an unchanging batch from `start`: step j ends at `end(j)`."""

    start: float
    batch: int
    context: int  # the batch's context at the first step; each step adds `batch` tokens
    step_s: float  # a step's cost without its context part
    context_s: float  # a step's cost per context token

    def end(self, steps: int) -> float:
        context = steps * self.context + self.batch * steps * (steps - 1) / 2
        return self.start + steps * self.step_s + self.context_s * context

    def steps_by(self, now: float, most: int) -> int:
        """Steps done by `now`, the step under way included (it is not cut short)."""
        low, high = 0, most
        while low < high:
            mid = (low + high) // 2
            if self.end(mid) >= now:
                high = mid
            else:
                low = mid + 1
        return low


@dataclass
class Copy:
    """A document's KV held on an engine (a document session's copy), with one query's blocks
    beside it: one query at a time runs in those, the others wait their turn, as on a live
    session (`WiMSession._room`), unless the engine runs them beside it (`Engine.run_query`)."""

    blocks: int
    active: int = 0  # jobs booked on it and not yet done
    last_used_s: float = 0.0
    read: bool = False  # its document is in (queries may run beside the one in turn)
    running: bool = False
    waiting: deque[Callable[[float], None]] = field(default_factory=deque)

    def take(self, start: Callable[[float], None], now: float) -> None:
        """Run `start(now)` if no query runs on the copy, else once those ahead of it end."""
        if self.running:
            self.waiting.append(start)
            return
        self.running = True
        start(now)

    def leave(self, start: Callable[[float], None] | None) -> bool:
        """Take `start` out of the line for the copy's turn; whether it was in it."""
        line = deque(waiting for waiting in self.waiting if waiting is not start)
        left, self.waiting = len(line) < len(self.waiting), line
        return left

    def query_ended(self, now: float) -> None:
        if self.waiting:
            self.waiting.popleft()(now)
        else:
            self.running = False


@dataclass
class Engine:
    """One replica. `schedule(time)` asks the simulator to call `wake(time)`; only the latest
    request counts (`version`)."""

    index: int
    profile: EngineProfile
    slots: int
    schedule: Callable[[Engine, float], None]
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per prefix hash (the trace's)
    capacity_blocks: int = 0
    free_blocks: int = 0
    # The share of its KV a query beside the one in turn must leave free (`SimSettings`).
    side_by_side_kv_reserve: float = 0.0
    copies: dict[str, Copy] = field(default_factory=dict)
    cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    queue: deque[Prefill] = field(default_factory=deque)
    batch: list[Sequence] = field(default_factory=list)
    version: int = 0
    lost: bool = False  # its replica died: it holds and runs nothing more
    _prefill: Prefill | None = None
    _void: bool = False  # the prefill under way was for a job stopped since: its end is moot
    _run: DecodeRun | None = None
    _run_steps: int = 0
    _busy_until: float = 0.0
    # The jobs placed here, as a live replica books them: what it reports as its backlog.
    backlog: Backlog = field(init=False)

    def __post_init__(self) -> None:
        self.backlog = Backlog(self.profile)
        self.capacity_blocks = self.profile.kv_capacity_tokens // self.profile.block_tokens
        self.free_blocks = self.capacity_blocks
        self.cache = PrefixCache(self.profile.kv_capacity_tokens // self.prefix_block_tokens)

    # -- what placement sees ------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"r{self.index:02d}"

    def report(self, now: float) -> LoadReport:
        """Its load as a live replica reports it (`ReplicaLoad`) as of `now`: its KV and
        slots exact, its backlog and running jobs by the replica's own estimate (`Backlog`),
        not by what this engine knows of its queue, so that placement reads what it reads
        in the service."""
        return LoadReport(
            self.name,
            capacity_blocks=self.capacity_blocks,
            reserved_blocks=self.capacity_blocks - self.free_blocks,
            sessions=len(self.copies),
            max_sessions=self.slots,
            backlog_s=self.backlog.seconds(now),
            running=self.backlog.running,
        )

    # -- booking ------------------------------------------------------------------------

    def book(self, blocks: int, *, document: str | None, copy_blocks: int = 0) -> Copy | None:
        """Reserve a placed job's KV (a copy holds a session slot too); with `copy_blocks`,
        open a copy of its document here and reserve its KV at once (the read is queued, and
        nothing placed meanwhile may count on those blocks). A document job's copy is
        returned."""
        self.free_blocks -= blocks
        if document is None:  # a plain request: KV only, no session slot
            return None
        if copy_blocks:
            self.copies[document] = Copy(blocks=copy_blocks)
            self.free_blocks -= copy_blocks
            self._resize_cache()
        copy = self.copies[document]
        copy.active += 1
        return copy

    def run_query(self, copy: Copy, blocks: int, start: Callable[[float], None], now: float) -> int:
        """Start a query on `copy`: in its turn (`Copy.take`), or at once beside the query
        in turn, in `blocks` of its own, if the copy is read and the engine has them free with
        `side_by_side_kv_reserve` of its KV still free after (as a live session does, by
        `KVAdmission.acquire_now`). Returns the blocks it holds beside (0: it runs in turn)."""
        keep_free = kept_free_blocks(self.capacity_blocks, self.side_by_side_kv_reserve)
        if copy.running and copy.read and blocks + keep_free <= self.free_blocks:
            self.free_blocks -= blocks
            start(now)
            return blocks
        copy.take(start, now)
        return 0

    def release(
        self, blocks: int, now: float, *, document: str | None, in_turn: bool = True
    ) -> None:
        """Give back a job's KV (and, `in_turn`, its copy's turn to the next query)."""
        self.free_blocks += blocks
        if document is None:
            return
        copy = self.copies[document]
        copy.active -= 1
        copy.last_used_s = now
        if in_turn:
            copy.query_ended(now)

    def retire_if_idle(self, document: str, now: float, idle_s: float) -> bool:
        """Drop a copy no job has used for `idle_s`; whether it was dropped."""
        copy = self.copies.get(document)
        if copy is None or copy.active or now - copy.last_used_s < idle_s:
            return False
        del self.copies[document]
        self.free_blocks += copy.blocks
        self._resize_cache()
        return True

    def lose(self) -> None:
        """The replica dies: what it held and ran is gone, what it had scheduled never
        happens (a later `wake` is stale)."""
        self.lost = True
        self.version += 1
        self.copies.clear()
        self.queue.clear()
        self.batch.clear()
        self._prefill = self._run = None
        self._void = False
        self.backlog = Backlog(self.profile)
        self.free_blocks = self.capacity_blocks

    def stop(self, owner: Owner, now: float) -> None:
        """Abort `owner`'s work, as vLLM aborts a request between steps: its queued prefills
        go, its sequences leave the batch after the decode step under way, and the end of
        its prefill under way (one step here: no chunked prefill) is ignored."""
        self.queue = deque(p for p in self.queue if p.job is not owner)
        self._void |= self._prefill is not None and self._prefill.job is owner
        kept = [s for s in self.batch if s.owner is not owner]
        if len(kept) < len(self.batch):
            self.batch = kept
            if self._run is not None:  # the run's timing still counts it until this step ends
                self._interrupt(now)

    def _resize_cache(self) -> None:
        # vLLM keeps cached prefixes in KV blocks no copy holds; eviction happens on insert.
        held = sum(c.blocks for c in self.copies.values()) * self.profile.block_tokens
        free = max(0, self.profile.kv_capacity_tokens - held)
        self.cache.capacity_blocks = free // self.prefix_block_tokens

    # -- work ---------------------------------------------------------------------------

    def submit(self, prefill: Prefill, now: float) -> None:
        """Queue a prefill; a decode run pauses after its current step."""
        self.queue.append(prefill)
        if self._run is not None:
            self._interrupt(now)
        elif self._prefill is None:
            self._start_next(now)

    def decode(self, owner: Owner, count: int, steps: int, context: int) -> None:
        """Add `count` sequences of `steps` decode steps each to the batch (between runs: a
        prefill has just ended or a sequence has)."""
        assert self._run is None
        self.batch.extend(Sequence(owner, steps, context) for _ in range(count))

    def wake(self, now: float) -> None:
        """The prefill or decode run that the last `schedule` timed has ended."""
        if self._prefill is not None:
            prefill, self._prefill = self._prefill, None
            if not self._void:
                prefill.finish(self, now)
            self._void = False
        elif self._run is not None:
            self._end_run(now)
        self._start_next(now)

    def _start_next(self, now: float) -> None:
        if self._prefill is not None or self._run is not None:
            return
        if self.queue:
            self._prefill = self.queue.popleft()
            self._busy_until = now + self._prefill.begin(self)
            self._at(self._busy_until)
        elif self.batch:
            decode = self.profile.decode
            self._run = DecodeRun(
                start=now,
                batch=len(self.batch),
                context=sum(s.context for s in self.batch),
                step_s=decode.fixed_s + len(self.batch) * decode.per_sequence_s,
                context_s=decode.per_context_token_s,
            )
            self._run_steps = min(s.remaining for s in self.batch)
            self._at(self._run.end(self._run_steps))

    def _interrupt(self, now: float) -> None:
        assert self._run is not None
        self._run_steps = self._run.steps_by(now, self._run_steps)
        self._at(self._run.end(self._run_steps))

    def _end_run(self, now: float) -> None:
        steps, self._run = self._run_steps, None
        done: list[Sequence] = []
        kept: list[Sequence] = []
        for sequence in self.batch:
            sequence.remaining -= steps
            sequence.context += steps  # each step adds a token to every sequence
            (done if sequence.remaining <= 0 else kept).append(sequence)
        self.batch = kept
        for sequence in done:  # after the batch is consistent: an owner may queue a prefill
            sequence.owner.decoded(self, now)

    def _at(self, time: float) -> None:
        self.version += 1
        self.schedule(self, time)
