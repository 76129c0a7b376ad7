"""The least TTFT any placement could give a trace's requests (`sim/floor.py`): what each
request costs alone, which requests it leaves out, and the line `wim sim` prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.fakes.profile import PROFILE_FIELDS
from wim_service.placement.profile import EngineProfile
from wim_service.sim.floor import floor_line, ttft_floor
from wim_service.sim.replay import simulate
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Request, Trace

# 718 blocks of 32 tokens per replica (23,000 // 32), and a restore far cheaper than a read:
# a floor that charged a first read as a restore would show.
PROFILE = EngineProfile.model_validate(
    PROFILE_FIELDS | {"restore": {"fixed_s": 0.01, "per_token_s": 1e-6}}
)
SETTINGS = SimSettings(segment_tokens=1024, margin_tokens=5)
CAPACITY_BLOCKS = 23000 // 32


def _query(index: int, document: str, *, margins: int | None = None) -> Request:
    return Request(
        index=index,
        arrival_s=float(index),
        prompt_tokens=3040,
        answer_tokens=16,
        document=document,
        document_tokens=3000,
        query_tokens=40,
        wim=True,
        session=f"s-{document}",
        margins=margins,
    )


def _alone_on_its_copy(margins: int) -> float:
    """A WiM query's first token on a replica that holds its document, nothing else running:
    its margins' prompts, their other 4 tokens decoded side by side (the first comes with the
    prefill), then its query with the margins' 5-token notes (and the answers started early
    when it writes margins)."""
    p = PROFILE
    extra = p.query_extra_tokens if margins else 0
    seconds = p.prefill.seconds(40 + margins * 5 + extra, cached=3000)
    if margins:
        seconds += p.prefill.seconds(margins * p.margin_prompt_tokens, cached=3000)
        context = margins * (3000 + p.margin_prompt_tokens + 5 / 2)
        seconds += p.decode_seconds(4, margins, round(context))
    return seconds


def test_a_documents_first_query_reads_it_and_later_ones_find_it() -> None:
    trace = Trace("document", (_query(0, "a"), _query(1, "a"), _query(2, "b")))
    floors = ttft_floor(trace, PROFILE, SETTINGS)
    margins = 3  # ceil(3000 / 1024)
    # The first read of a document is a prefill of its text: nothing of it was saved yet.
    read = PROFILE.prefill.seconds(3000)
    assert read > 10 * PROFILE.read_seconds(3000, saved=True)
    assert floors == pytest.approx(
        {
            0: read + _alone_on_its_copy(margins),
            1: _alone_on_its_copy(margins),
            2: read + _alone_on_its_copy(margins),
        }
    )


@pytest.mark.parametrize("policy", ["round_robin", "sticky", "expected_wait"])
def test_a_query_that_arrives_mid_read_waits_for_the_rest_of_it(policy: str) -> None:
    """No replica holds a document's KV before its first read ends, and a read of the query's
    own would end later: the floor waits, and no policy's replay answers sooner."""
    trace = Trace("document", (_query(0, "a"), replace(_query(1, "a"), arrival_s=0.4)))
    floors = ttft_floor(trace, PROFILE, SETTINGS)
    read = PROFILE.prefill.seconds(3000)
    assert read > 0.4
    assert floors[1] == pytest.approx(read - 0.4 + _alone_on_its_copy(3))
    result = simulate(trace, policy, 2, PROFILE, SETTINGS)
    ttft = {o.index: o.first_token_s - o.arrival_s for o in result.outcomes}
    # Within a millionth: the floor decodes its margins over a context rounded to whole tokens
    # (`EngineProfile.lone_query_seconds`), the replay over the exact one.
    assert ttft[1] >= floors[1] * (1 - 1e-6)


def test_a_query_writes_the_margins_its_row_names() -> None:
    trace = Trace(
        "document", (_query(0, "a"), _query(1, "a", margins=1), _query(2, "a", margins=0))
    )
    floors = ttft_floor(trace, PROFILE, SETTINGS)
    assert floors[1] == pytest.approx(_alone_on_its_copy(1))
    assert floors[2] == pytest.approx(_alone_on_its_copy(0))
    assert floors[2] < floors[1] < floors[0]


def test_a_request_that_fills_a_replica_has_a_floor_one_larger_has_none() -> None:
    tokens = CAPACITY_BLOCKS * 32  # its prompt and answer take every block
    fits = Request(index=0, arrival_s=0.0, prompt_tokens=tokens - 10, answer_tokens=10)
    over = Request(index=1, arrival_s=1.0, prompt_tokens=tokens - 10, answer_tokens=11)
    floors = ttft_floor(Trace("mooncake", (fits, over)), PROFILE, SETTINGS)
    assert floors == pytest.approx({0: PROFILE.prefill.seconds(tokens - 10)})


def test_a_query_on_a_document_larger_than_a_replica_has_none() -> None:
    small = _query(0, "a")
    huge = Request(
        index=1,
        arrival_s=1.0,
        prompt_tokens=30040,
        answer_tokens=16,
        document="b",
        document_tokens=30000,
        query_tokens=40,
        wim=True,
        session="s-b",
    )
    assert list(ttft_floor(Trace("document", (small, huge)), PROFILE, SETTINGS)) == [0]


def test_a_prompt_after_a_shared_prefix_prefills_only_the_rest() -> None:
    first = Request(
        index=0, arrival_s=0.0, prompt_tokens=2048, answer_tokens=8, prefix=(1, 2, 3, 4)
    )
    again = Request(
        index=1, arrival_s=1.0, prompt_tokens=2048, answer_tokens=8, prefix=(1, 2, 9, 9)
    )
    floors = ttft_floor(Trace("mooncake", (first, again)), PROFILE, SETTINGS)  # 512-token blocks
    assert floors[0] == pytest.approx(PROFILE.prefill.seconds(2048))
    assert floors[1] == pytest.approx(PROFILE.prefill.seconds(1024, cached=1024))


def test_the_line_names_the_floors_percentiles() -> None:
    floors = {index: float(index) for index in range(101)}  # p50 50 s, p95 95 s, p99 99 s
    assert floor_line(floors) == (
        "floor: TTFT p50 50.00 s, p95 95.00 s, p99 99.00 s (each request alone on a replica "
        "caching every earlier prefix: no placement does better)"
    )
    assert floor_line({}) == "floor: no request fits a replica"


def test_a_lone_query_reaches_its_floor_in_the_replay() -> None:
    """The floor is a time the simulated engines give: a document's first query, then a second
    one after it ended (within the session's life), each alone on an idle fleet, take exactly
    their floors."""
    trace = Trace("document", (_query(0, "a"), replace(_query(1, "a"), arrival_s=50.0)))
    floors = ttft_floor(trace, PROFILE, SETTINGS)
    result = simulate(trace, "expected_wait", 2, PROFILE, SETTINGS)
    ttft = {o.index: o.first_token_s - o.arrival_s for o in result.outcomes}
    assert ttft == pytest.approx(floors)
