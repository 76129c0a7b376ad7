"""`wim sim` (`wim_service/sim/`): trace readers, the generator, the replay's bookkeeping and
what the policies do to it, and the command. No engine, no network.

The speed of the replay is measured, not asserted here: `scripts/bench_sim.sh` times 64
replicas over the shipped 4,000-request Mooncake trace.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.profile import PROFILE
from wim_service.cli import main
from wim_service.sim.engine import DecodeRun
from wim_service.sim.floor import ttft_floor
from wim_service.sim.generate import GeneratorOptions, generate, write_trace
from wim_service.sim.jobs import work_for
from wim_service.sim.replay import simulate
from wim_service.sim.report import KEYS, figures, percentile, summarise, table
from wim_service.sim.result import RunResult
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import DOCUMENT_BLOCK_TOKENS, Request, Trace, TraceError, read_trace

POLICIES = ("round_robin", "sticky", "expected_wait")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake_row(ms: int, tokens: int, hashes: list[int], out: int = 20) -> dict[str, Any]:
    return {"timestamp": ms, "input_length": tokens, "output_length": out, "hash_ids": hashes}


def doc_row(t: float, document: str, *, wim: bool, tokens: int = 3000) -> dict[str, Any]:
    return {
        "timestamp_s": t,
        "session_id": f"s-{document}",
        "document_id": document,
        "document_tokens": tokens,
        "query_tokens": 40,
        "answer_tokens": 16,
        "wim": wim,
    }


def run(trace: Trace, policy: str, replicas: int, **settings: Any) -> RunResult:
    return simulate(trace, policy, replicas, PROFILE, SimSettings(**settings))


# -- traces ---------------------------------------------------------------------------------


def test_mooncake_reader_reads_gzip_and_orders_by_time(tmp_path: Path) -> None:
    rows = [mooncake_row(3000, 1500, [0, 1, 2]), mooncake_row(1000, 600, [0, 7])]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(json.dumps(row) + "\n" for row in rows) + "\n")  # a blank line too
    trace = read_trace(path)
    assert trace.kind == "mooncake"
    first, second = trace.requests
    assert (first.arrival_s, first.prompt_tokens, first.prefix, first.index) == (
        1.0,
        600,
        (0, 7),
        0,
    )
    assert (second.arrival_s, second.answer_tokens, second.index) == (3.0, 20, 1)
    assert trace.scaled(2.5).requests[1].arrival_s == 7.5


def test_document_reader_gives_wim_rows_a_session_and_plain_rows_the_documents_blocks(
    tmp_path: Path,
) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            doc_row(0, "a", wim=True),
            doc_row(1, "a", wim=False),
            doc_row(2, "a", wim=False),
            doc_row(3, "b", wim=False),
        ],
    )
    trace = read_trace(path)
    wim, plain_a, plain_a2, plain_b = trace.requests
    assert trace.kind == "document"
    assert (wim.document, wim.prefix, wim.prompt_tokens) == ("a", (), 3040)
    # Only the document's whole KV blocks are shared: 3000 // 32 = 93.
    assert plain_a.document == "a" and len(plain_a.prefix) == 3000 // DOCUMENT_BLOCK_TOKENS
    assert plain_a.prefix == plain_a2.prefix
    assert not set(plain_a.prefix) & set(plain_b.prefix)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "t.jsonl:3: not JSON"),
        ("[1, 2]", "t.jsonl:3: not a JSON object"),
        ('{"timestamp": 5, "input_length": -1, "output_length": 1, "hash_ids": []}', ":3: input"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": "x"}', ":3: hash"),
    ],
)
def test_a_malformed_line_is_named_by_its_number(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, 100, [1])])
    path.write_text(path.read_text() + "\n" + line + "\n")  # line 2 is blank
    with pytest.raises(TraceError, match=message):
        read_trace(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"document_tokens": "900"}, "document_tokens must be an integer within 1-1,000,000"),
        ({"answer_tokens": True}, "answer_tokens must be an integer within 1-"),
        ({"wim": 1}, "wim must be true or false"),
        ({"wim": None}, "wim must be true or false"),
        ({"timestamp_s": -1}, "timestamp_s must be a number within 0-"),
        ({"document_id": ""}, "document_id must be a non-empty string"),
    ],
)
def test_a_malformed_document_row_is_named_by_its_line(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [doc_row(0, "a", wim=True)])
    path.write_text(path.read_text() + "\n" + json.dumps(doc_row(1, "a", wim=True) | change) + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:3: {message}"):
        read_trace(path)


def test_a_document_trace_is_read_in_arrival_order(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl", [doc_row(5, "a", wim=True), doc_row(1.5, "b", wim=False)]
    )
    trace = read_trace(path)
    assert [(r.index, r.arrival_s, r.document, r.wim) for r in trace.requests] == [
        (0, 1.5, "b", False),
        (1, 5.0, "a", True),
    ]


def test_a_trace_of_no_known_kind_or_without_requests_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"x.jsonl:1: unknown trace kind"):
        read_trace(write_jsonl(tmp_path / "x.jsonl", [{"timestamp": 1}]))
    with pytest.raises(TraceError, match="has no requests"):
        read_trace(write_jsonl(tmp_path / "e.jsonl", []))
    with pytest.raises(TraceError, match="no trace file"):
        read_trace(tmp_path / "missing.jsonl")


def test_the_shipped_mooncake_trace_is_package_data() -> None:
    shipped = resources.files("wim_service.sim").joinpath(
        "traces", "mooncake_conversation_4000.jsonl.gz"
    )
    trace = read_trace(Path(str(shipped)))
    assert (trace.kind, len(trace.requests)) == ("mooncake", 4000)
    # Conversation turns share prefixes: some hash appears in many requests.
    firsts = [r.prefix[0] for r in trace.requests if r.prefix]
    assert max(firsts.count(h) for h in set(firsts[:200])) > 10


# -- the generator --------------------------------------------------------------------------


def test_the_generator_is_deterministic_and_zipf_popular() -> None:
    options = GeneratorOptions(requests=600, documents=10, zipf_exponent=1.2, seed=3)
    rows = generate(options)
    assert rows == generate(options)
    assert rows != generate(replace(options, seed=4))
    assert len(rows) == 600
    assert [r["timestamp_s"] for r in rows] == sorted(r["timestamp_s"] for r in rows)
    counts = {d: sum(r["document_id"] == d for r in rows) for d in {r["document_id"] for r in rows}}
    assert max(counts, key=lambda d: counts[d]) == "doc-0000"
    lengths = {(r["document_id"], r["document_tokens"]) for r in rows}
    assert len(lengths) == len(counts)  # one length per document
    assert 0.5 < sum(r["wim"] for r in rows) / len(rows) < 0.9  # wim_fraction 0.7


def test_a_generated_trace_reads_back_as_a_document_trace(tmp_path: Path) -> None:
    rows = generate(GeneratorOptions(requests=50, seed=1))
    path = tmp_path / "g.jsonl"
    write_trace(rows, path)
    trace = read_trace(path)
    assert trace.kind == "document" and len(trace.requests) == 50


def test_generator_options_are_checked() -> None:
    with pytest.raises(ValueError, match="document_tokens HIGH"):
        generate(GeneratorOptions(document_tokens=(900, 100)))
    with pytest.raises(ValueError, match="duration"):
        generate(GeneratorOptions(duration_s=0))


def test_a_duration_leaves_out_the_later_queries() -> None:
    options = GeneratorOptions(requests=200, rate=1.0, seed=5)
    within = generate(replace(options, duration_s=60))
    assert within == [r for r in generate(options) if r["timestamp_s"] <= 60]
    assert 0 < len(within) < 200


# -- the engine's arithmetic ----------------------------------------------------------------


def test_a_decode_run_sums_its_steps_in_closed_form() -> None:
    decode = PROFILE.decode
    run_ = DecodeRun(
        start=10.0,
        batch=3,
        context=9000,
        step_s=decode.fixed_s + 3 * decode.per_sequence_s,
        context_s=decode.per_context_token_s,
    )
    stepped = 10.0 + sum(decode.step_seconds(3, 9000 + 3 * j) for j in range(40))
    assert run_.end(40) == pytest.approx(stepped)
    # Cut short: the step under way at `now` still ends.
    assert run_.steps_by(run_.end(7) - 1e-6, 40) == 7
    assert run_.steps_by(run_.end(7), 40) == 7
    assert run_.steps_by(10.0, 40) == 0


def test_percentiles_interpolate() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="not in"):
        percentile(values, 101)


def test_figures_are_none_without_completed_requests() -> None:
    row = figures([], [], prompt_tokens=0, cached_tokens=0, span_s=0.0)
    assert row["completed"] == 0
    assert all(row[key] is None for key in KEYS if key not in ("policy", "replicas", "completed"))


def test_the_table_takes_its_columns_and_marks_missing_figures() -> None:
    rows = [
        {
            "policy": "expected_wait",
            "replicas": 2,
            "ttft_p50_s": None,
            "prefix_reuse": 0.25,
            "failed": 1,
        },
        {"policy": "sticky", "replicas": 2, "ttft_p50_s": 1.234, "prefix_reuse": None},
    ]
    columns = ["policy", "ttft_p50_s", "prefix_reuse", "failed"]
    header, rule, first, second = table(rows, columns).splitlines()
    assert [c.strip() for c in header.split("|")[1:-1]] == [
        "policy",
        "TTFT p50 s",
        "prefix reuse",
        "failed",
    ]
    assert [c.strip() for c in first.split("|")[1:-1]] == ["expected_wait", "-", "25.0%", "1"]
    assert [c.strip() for c in second.split("|")[1:-1]] == ["sticky", "1.23", "-", "-"]
    assert len({len(line) for line in (header, rule, first, second)}) == 1  # aligned


# -- replays --------------------------------------------------------------------------------


def light_mooncake(requests: int = 120, gap_s: float = 4.0, groups: int = 6) -> Trace:
    """Requests spaced `gap_s` apart, in `groups` conversations sharing a 10-block prefix."""
    rows = []
    for i in range(requests):
        group = i % groups
        shared = [1000 * group + b for b in range(10)]
        rows.append(
            Request(
                index=i,
                arrival_s=i * gap_s,
                prompt_tokens=6000,
                answer_tokens=30,
                prefix=(*shared, 100_000 + i, 200_000 + i),
            )
        )
    return Trace("mooncake", tuple(rows))


def document_trace(rows: list[dict[str, Any]], tmp_path: Path) -> Trace:
    return read_trace(write_jsonl(tmp_path / "docs.jsonl", rows))


def test_a_lone_request_takes_its_prefill_then_its_decode_steps() -> None:
    request = Request(index=0, arrival_s=5.0, prompt_tokens=2000, answer_tokens=4)
    (outcome,) = run(Trace("mooncake", (request,)), "expected_wait", 1).outcomes
    prefill = PROFILE.prefill.seconds(2000)
    steps = sum(PROFILE.decode.step_seconds(1, 2001 + j) for j in range(3))
    assert outcome.first_token_s - 5.0 == pytest.approx(prefill)
    assert outcome.end_s - outcome.first_token_s == pytest.approx(steps)


def test_a_lone_wim_query_reads_writes_its_margins_then_answers(tmp_path: Path) -> None:
    trace = document_trace([doc_row(0, "a", wim=True, tokens=3000)], tmp_path)
    (outcome,) = run(trace, "expected_wait", 1, segment_tokens=1024, margin_tokens=5).outcomes
    p, margins = PROFILE, 3  # ceil(3000 / 1024)
    read = p.prefill.seconds(3000)
    prompts = p.prefill.seconds(margins * p.margin_prompt_tokens, cached=3000)
    context = margins * (3000 + p.margin_prompt_tokens + 1)
    decode = sum(p.decode.step_seconds(margins, context + margins * j) for j in range(4))
    query = p.prefill.seconds(40 + margins * 5 + p.query_extra_tokens, cached=3000)
    assert outcome.first_token_s == pytest.approx(read + prompts + decode + query)
    # What calibration fits `query_extra_tokens` with: the same steps, the decode's context taken
    # at its mean.
    alone = p.lone_query_seconds(3000, 40, margins, 5)
    assert outcome.first_token_s - read == pytest.approx(alone, rel=1e-4)
    # The session's read went first, on its own (as the live client opens it): the query then
    # finds the document in its copy.
    assert (outcome.prompt_tokens, outcome.cached_tokens) == (3040, 3000)


def test_a_wim_query_writes_only_the_margins_its_row_names(tmp_path: Path) -> None:
    """`margins: 1`: the other segments are skipped (WiM's `margin_skip`); `margins: 0`: none
    is written, the query follows the document at once."""
    rows = [doc_row(0, "a", wim=True), doc_row(100, "a", wim=True), doc_row(200, "a", wim=True)]
    rows[1]["margins"], rows[2]["margins"] = 1, 0
    trace = document_trace(rows, tmp_path)
    assert [r.margins for r in trace.requests] == [None, 1, 0]
    every, one, none = sorted(
        run(trace, "expected_wait", 1, segment_tokens=1024, margin_tokens=5).outcomes,
        key=lambda o: o.index,
    )
    p = PROFILE
    prompt = p.prefill.seconds(p.margin_prompt_tokens, cached=3000)
    decode = sum(p.decode.step_seconds(1, 3000 + p.margin_prompt_tokens + 1 + j) for j in range(4))
    query = p.prefill.seconds(40 + 5 + p.query_extra_tokens, cached=3000)
    assert one.first_token_s - 100 == pytest.approx(prompt + decode + query)
    # Without margins nothing is answered early: no `query_extra_tokens`.
    assert none.first_token_s - 200 == pytest.approx(p.prefill.seconds(40, cached=3000))
    assert every.first_token_s - 0 > p.prefill.seconds(3000) + one.first_token_s - 100
    bad = {**doc_row(0, "a", wim=True), "margins": -1}
    with pytest.raises(TraceError, match="margins must be an integer within 0-94,"):
        document_trace([bad], tmp_path)
    generated = generate(GeneratorOptions(requests=20, margins=2, seed=3))
    assert {r.get("margins") for r in generated if r["wim"]} == {2}
    assert all("margins" not in r for r in generated if not r["wim"])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_once_when_capacity_allows(policy: str, tmp_path: Path) -> None:
    rows = generate(GeneratorOptions(requests=150, rate=0.3, documents=6, seed=2))
    for trace in (document_trace(rows, tmp_path), light_mooncake()):
        result = run(trace, policy, 3)
        indexes = sorted(o.index for o in result.outcomes)
        assert indexes == list(range(len(trace.requests)))
        assert summarise(result)["completed"] == len(trace.requests)
        assert all(o.arrival_s <= o.first_token_s <= o.end_s for o in result.outcomes)
        assert result.refused == result.too_large == 0


def test_prefix_reuse_is_higher_for_sticky_and_expected_wait_than_round_robin() -> None:
    trace = light_mooncake(gap_s=1.0)
    reuse = {p: summarise(run(trace, p, 4))["prefix_reuse"] for p in POLICIES}
    assert reuse["sticky"] > reuse["round_robin"]
    assert reuse["expected_wait"] > reuse["round_robin"]


def hot_document(tmp_path: Path) -> Trace:
    rows = generate(
        GeneratorOptions(
            requests=300,
            rate=2.0,
            documents=3,
            zipf_exponent=3.0,
            queries_per_session=1,
            wim_fraction=1.0,
            document_tokens=(4000, 4000),
            seed=0,
        )
    )
    assert sum(r["document_id"] == "doc-0000" for r in rows) > 0.8 * len(rows)
    return document_trace(rows, tmp_path)


@pytest.mark.parametrize("replicas", [4, 8])
def test_a_hot_document_gets_copies_under_expected_wait_and_a_lower_p95(
    tmp_path: Path, replicas: int
) -> None:
    trace = hot_document(tmp_path)
    sticky, expected = (run(trace, p, replicas) for p in ("sticky", "expected_wait"))
    documents = len({r.document for r in trace.requests})
    assert sticky.copies_opened == documents  # one copy per document, ever
    assert expected.copies_opened > documents
    assert summarise(expected)["ttft_p95_s"] < summarise(sticky)["ttft_p95_s"]
    hot = [o for o in expected.outcomes if trace.requests[o.index].document == "doc-0000"]
    hot_on = {o.replica for o in hot}
    assert len(hot_on) > 1


def test_more_replicas_never_worsen_round_robins_p95_on_a_light_trace() -> None:
    # No shared prefixes: which replica a conversation's turns meet would blur the queueing.
    trace = light_mooncake(gap_s=1.0, groups=120)
    p95 = [summarise(run(trace, "round_robin", n))["ttft_p95_s"] for n in (1, 2, 4, 8)]
    assert p95 == sorted(p95, reverse=True)
    assert p95[0] > p95[-1]


@pytest.mark.parametrize(("all_kv", "reserve"), [(True, 0.0), (False, 0.0), (True, 0.99)])
def test_queries_on_one_copy_run_beside_each_other_if_the_engine_has_room(
    tmp_path: Path, all_kv: bool, reserve: float
) -> None:
    # Three queries of one document at once on one replica, as on a live session: one in the
    # copy's own blocks, the others beside it in their own if free with `side_by_side_kv_reserve`
    # of the KV left; if the copy fills the KV, or 99% is kept free, they take turns.
    rows = [doc_row(0.0, "a", wim=True), doc_row(0.0, "a", wim=True), doc_row(0.0, "a", wim=True)]
    trace = document_trace(rows, tmp_path)
    settings = SimSettings(side_by_side_kv_reserve=reserve)
    copy_blocks = work_for(trace.requests[0], PROFILE, settings, 32).document_blocks
    tokens = PROFILE.kv_capacity_tokens if all_kv else copy_blocks * PROFILE.block_tokens
    profile = PROFILE.model_copy(update={"kv_capacity_tokens": tokens})
    result = simulate(trace, "sticky", 1, profile, settings)
    first, second, third = sorted(result.outcomes, key=lambda o: o.first_token_s)
    if all_kv and not reserve:
        assert second.first_token_s < first.end_s and third.first_token_s < first.end_s
    else:
        assert second.first_token_s > first.end_s and third.first_token_s > second.end_s
    assert (result.copies_opened, result.refused) == (1, 0)


def test_a_session_is_opened_on_its_own_then_asked_as_the_live_client_does(
    tmp_path: Path,
) -> None:
    # Round robin: the session's read takes the first turn (r0); its two queries, which
    # arrived while it was read, are placed after it, the next turns: r1 (reading a copy),
    # then r0 (the session's own copy). Three segments of margins: the times below allow for
    # those, not the service's default six.
    rows = [doc_row(0.0, "a", wim=True), doc_row(0.1, "a", wim=True)]
    trace = document_trace(rows, tmp_path)
    result = run(trace, "round_robin", 2, segment_tokens=1024, margin_tokens=24)
    first, second = sorted(result.outcomes, key=lambda o: o.index)
    assert (first.replica, second.replica, result.copies_opened) == (1, 0, 2)
    read = PROFILE.prefill.seconds(3000)
    assert first.first_token_s > 2 * read and read < second.first_token_s < 2 * read
    # Reported as live: a read is the router's request, not part of the query's prompt.
    assert first.cached_tokens == second.cached_tokens == 3000


def test_a_job_without_room_is_sent_again_and_its_retries_count_in_its_ttft(
    tmp_path: Path,
) -> None:
    # One replica, one session slot: b's session is refused (429) and sent again after each
    # Retry-After, as its client retries, until a's copy has been retired.
    trace = document_trace([doc_row(0, "a", wim=True), doc_row(0.5, "b", wim=True)], tmp_path)
    result = run(trace, "wim", 1, slots=1, copy_idle_s=30.0, retries=20)
    assert (result.refused, result.copies_opened, result.copies_retired) == (0, 2, 2)
    assert result.retried > 0
    a, b = sorted(result.outcomes, key=lambda o: o.index)
    assert b.first_token_s > a.end_s + 30.0
    assert b.cached_tokens == a.cached_tokens == 3000  # each on its session's own copy


def test_without_room_an_idle_spare_copy_makes_room(tmp_path: Path) -> None:
    # Two replicas of one session slot each. Round robin reads a's session on r0 and its
    # query a copy on r1; both idle when b comes, which finds no slot: one of a's two copies
    # is retired for it at once, not after copy_idle_s. (A document's last copy is not:
    # `test_a_job_without_room_is_sent_again_and_its_retries_count_in_its_ttft`.)
    rows = [doc_row(0, "a", wim=True), doc_row(60, "b", wim=True), doc_row(61, "a", wim=True)]
    result = run(document_trace(rows, tmp_path), "round_robin", 2, slots=1, copy_idle_s=300.0)
    a, b, a_again = sorted(result.outcomes, key=lambda o: o.index)
    assert a.end_s < 60 and b.first_token_s < 80
    assert (result.copies_reclaimed, result.refused) == (1, 0)
    assert b.cached_tokens == a.cached_tokens == 3000
    # a kept one copy, and b's session took the other's place: a's next query reads none.
    assert result.copies_opened == 3
    assert a_again.first_token_s - 61 < b.first_token_s - 60
    assert result.copies_retired == 3  # the reclaimed one, and the two idle at the end


@pytest.mark.parametrize("policy", ["round_robin", "sticky", "expected_wait"])
def test_plain_requests_run_beside_sessions_that_hold_every_slot(
    policy: str, tmp_path: Path
) -> None:
    # One replica, one session slot, held by a's session all along (its copy is never idle
    # long enough to retire): the plain request over a's document is admitted by its KV alone,
    # as a live engine admits it, and does not wait for the slot.
    rows = [doc_row(0, "a", wim=True), doc_row(1, "a", wim=False), doc_row(2, "a", wim=True)]
    result = run(document_trace(rows, tmp_path), policy, 1, slots=1, copy_idle_s=300.0)
    assert (len(result.outcomes), result.refused, result.copies_opened) == (3, 0, 1)
    plain = next(o for o in result.outcomes if o.index == 1)
    assert plain.first_token_s - 1 < PROFILE.prefill.seconds(3040) + 5


def test_expected_wait_spreads_a_burst_by_the_backlog_it_books() -> None:
    # Eight distinct prompts at once on four replicas: each booking raises that replica's
    # backlog, so the next one goes elsewhere, two per replica.
    burst = tuple(
        Request(index=i, arrival_s=0.0, prompt_tokens=3000, answer_tokens=20, prefix=(i,))
        for i in range(8)
    )
    result = run(Trace("mooncake", burst), "expected_wait", 4)
    per_replica = [sum(o.replica == r for o in result.outcomes) for r in range(4)]
    assert per_replica == [2, 2, 2, 2]


def test_a_copy_being_read_already_holds_its_kv(tmp_path: Path) -> None:
    # Room for one 3,000-token copy and its query (106 blocks of 125), not two: b, arriving
    # while a's copy is still being read, is refused until a's copy has retired.
    small = PROFILE.model_copy(update={"kv_capacity_tokens": 4000})
    trace = document_trace([doc_row(0, "a", wim=True), doc_row(0.1, "b", wim=True)], tmp_path)
    result = simulate(trace, "wim", 1, small, SimSettings(copy_idle_s=10.0, retries=20))
    assert (result.refused, len(result.outcomes)) == (0, 2)
    assert result.retried > 0
    a, b = sorted(result.outcomes, key=lambda o: o.index)
    assert b.first_token_s > a.end_s + 10.0


@pytest.mark.parametrize("kind", ["mooncake", "document"])
def test_no_policy_serves_a_request_before_its_floor(kind: str, tmp_path: Path) -> None:
    if kind == "mooncake":
        trace = light_mooncake(requests=60, gap_s=1.0)
    else:
        rows = generate(GeneratorOptions(requests=80, rate=0.5, documents=4, seed=3))
        write_trace(rows, tmp_path / "docs.jsonl")
        trace = read_trace(tmp_path / "docs.jsonl")
    floors = ttft_floor(trace, PROFILE, SimSettings())
    assert len(floors) == len(trace.requests)
    for policy in ("round_robin", "sticky", "expected_wait"):
        for replicas in (1, 4):
            for o in run(trace, policy, replicas).outcomes:
                assert o.first_token_s - o.arrival_s >= floors[o.index] - 1e-9
    if kind == "mooncake":  # the first request alone: its whole prompt; a repeat: the rest
        assert floors[0] == pytest.approx(PROFILE.prefill.seconds(6000))
        cached = 10 * 512
        assert floors[6] == pytest.approx(PROFILE.prefill.seconds(6000 - cached, cached=cached))


def test_a_request_larger_than_a_replica_is_counted_not_placed() -> None:
    big = Request(index=0, arrival_s=0.0, prompt_tokens=PROFILE.kv_capacity_tokens, answer_tokens=9)
    small = Request(index=1, arrival_s=1.0, prompt_tokens=1000, answer_tokens=9)
    trace = Trace("mooncake", (big, small))
    result = run(trace, "expected_wait", 2)
    assert (result.too_large, [o.index for o in result.outcomes]) == (1, [1])
    assert list(ttft_floor(trace, PROFILE, SimSettings())) == [1]  # nor in the floor


# -- the command ----------------------------------------------------------------------------


def test_the_command_prints_a_row_per_policy_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, profile = tmp_path / "docs.jsonl", tmp_path / "profile.json"
    profile.write_text(PROFILE.model_dump_json())
    assert main(["sim", "--generate", str(trace), "--requests", "60", "--rate", "0.2"]) == 0
    out = tmp_path / "rows.json"
    argv = ["sim", "--trace", str(trace), "--replicas", "1,3", "--policies", "sticky,expected_wait"]
    argv += ["--profile", str(profile)]
    plot = tmp_path / "p95.png"
    assert main([*argv, "--json-out", str(out), "--time-scale", "2", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    lines = capsys.readouterr().out.splitlines()
    body = [line for line in lines if line.startswith("|") and "---" not in line][1:]
    assert [line.split("|")[1].strip() for line in body] == ["sticky", "expected_wait"] * 2
    assert lines[-1].startswith("floor: TTFT p50 ")
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["replicas"]) for r in rows] == [
        ("sticky", 1),
        ("expected_wait", 1),
        ("sticky", 3),
        ("expected_wait", 3),
    ]
    assert all(set(KEYS) <= set(r) and r["completed"] + r["refused"] == 60 for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "{tmp}/missing.jsonl"], "no trace file"),
        (["--trace", "{bad}"], "bad.jsonl:2: not JSON"),
        (["--trace", "{good}", "--policies", "wim,fastest"], "unknown placement policy 'fastest'"),
        (["--trace", "{good}", "--replicas", "0"], "within 1-64"),
        (["--trace", "{good}", "--replicas", "8,65"], "within 1-64"),
        (["--trace", "{good}", "--replicas", "many"], "counts like 8"),
        (["--trace", "{good}", "--profile", "{tmp}/none.json"], "no profile file"),
        (["--generate", "{tmp}/g.jsonl", "--document-tokens", "9-x"], "LOW-HIGH"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [mooncake_row(0, 100, [1])])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + "{oops\n")
    names = {"tmp": str(tmp_path), "good": str(good), "bad": str(bad)}
    assert main(["sim", *(arg.format(**names) for arg in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wim: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
