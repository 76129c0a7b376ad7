"""The simulator's settings besides the engine profile, and how options are checked."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from wim_service.placement.admission import DEFAULT_CHEAPEST_FIRST
from wim_service.placement.copies import DEFAULT_COPY_IDLE_S
from wim_service.placement.policy import DEFAULT_MAX_COPIES
from wim_service.placement.polls import DEFAULT_LOAD_POLL_S
from wim_service.sim.traces import MAX_ARRIVAL_S, MAX_RETRIES, MIN_SEGMENT_TOKENS
from wim_service.wim.capacity import DEFAULT_SIDE_BY_SIDE_KV_RESERVE
from wim_service.wim.options import WiMOptions

_OPTIONS = WiMOptions.model_fields

# A bound on one option: its name, its value, the least and the most it may be.
Bound = tuple[str, float | None, float, float]


def check_bounds(bounds: Iterable[Bound]) -> None:
    """Raise ValueError naming the first option out of its bounds (None: not given). NaN and
    infinities are refused too: they compare within no finite bounds."""
    for name, value, least, most in bounds:
        if value is not None and not least <= value <= most:
            within = f"{_number(least)}-{_number(most)}"
            raise ValueError(f"{name} must be within {within}, not {_number(value)}")


def _number(value: float) -> str:
    text = f"{value:,}" if isinstance(value, int) else f"{value:g}"
    return text if len(text) <= 20 else f"{text[:12]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class SimSettings:
    # Session slots per replica: copies held plus jobs running without one (the service's
    # max_sessions admission, 4 in its default deployment).
    slots: int = 4
    # A copy no job has used for this long is retired: its KV and slot come back.
    copy_idle_s: float = DEFAULT_COPY_IDLE_S
    # A WiM query writes one margin per segment of its document, of up to `margin_tokens`
    # tokens: the service's defaults (`WiMOptions`), so that a replay describes the service.
    segment_tokens: int = _OPTIONS["segment_tokens"].default
    margin_tokens: int = _OPTIONS["margin_max_tokens"].default
    max_copies: int = DEFAULT_MAX_COPIES  # copies of one document `expected_wait` may open
    # Placement takes the engines' reports this often, as the router polls its replicas
    # (`RouterConfig.load_poll_interval_s`), and between polls as it does (`placement/polls.py`).
    load_poll_s: float = DEFAULT_LOAD_POLL_S
    # Whether a copy of a document read before restores its KV from the KV store (the
    # profile's `restore` cost, if measured) instead of reading it again: `RouterConfig.
    # restore_copies`. On by default, as `./run.sh` runs with a store (docs/kv-store.md).
    restore_copies: bool = True
    # How the service refuses what it has no room for, and how long it lets a job run. The
    # router answers `429` with Retry-After `retry_after_s` (`RouterConfig.retry_after_s`) when
    # no replica has room for a new session or job; an engine replica takes at most
    # `replica_calls` calls at once and the router queues at most `queued_calls` more for the
    # engines (the engine deployment's `max_ongoing_requests` and `max_queued_requests`), past
    # which a call is refused the same way. A job still running `deadline_s` after it was sent
    # is stopped (`RouterConfig.request_timeout_s`): goodput counts the answers within it.
    retry_after_s: float = 5.0
    replica_calls: int = 64
    queued_calls: int = 256
    deadline_s: float = 900.0
    # Times a refused request is sent again (after its Retry-After) when its trace row does not
    # say (`retries`).
    retries: int = 0
    # Whether `expected_wait` refuses the costliest arrivals first while the fleet is short
    # (`placement/admission.py`; `RouterConfig.cheapest_first`).
    cheapest_first: bool = DEFAULT_CHEAPEST_FIRST
    # A query runs beside the one in its copy's turn only if this share of the engine's KV
    # stays free after it, as an engine replica runs it (`EngineConfig.side_by_side_kv_reserve`).
    side_by_side_kv_reserve: float = DEFAULT_SIDE_BY_SIDE_KV_RESERVE

    def check(self) -> None:
        """Within the bounds the live service takes (`WiMOptions`, `RouterConfig`)."""
        check_bounds(
            [
                ("slots", self.slots, 1, 65_536),
                ("copy_idle_s", self.copy_idle_s, 0, MAX_ARRIVAL_S),
                ("segment_tokens", self.segment_tokens, MIN_SEGMENT_TOKENS, 65_536),
                ("margin_tokens", self.margin_tokens, 1, 1_024),
                ("max_copies", self.max_copies, 1, 64),
                ("load_poll_s", self.load_poll_s, 0.001, MAX_ARRIVAL_S),
                ("retries", self.retries, 0, MAX_RETRIES),
                ("deadline_s", self.deadline_s, 0.001, MAX_ARRIVAL_S),
            ]
        )
        # A share below 1, as the engines take it (`EngineConfig`): the inclusive bounds above
        # cannot say so.
        if not 0 <= self.side_by_side_kv_reserve < 1:
            value = _number(self.side_by_side_kv_reserve)
            raise ValueError(f"side_by_side_kv_reserve must be at least 0 and below 1, not {value}")
