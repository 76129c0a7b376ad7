"""`wim bench`: WiM cost ratios, each measured side by side in one run on one machine.

(a) prompt tokens computed beyond the minimum, with prefix caching on and off;
(b) pipelined vs sequential wall time, with the overlap limit beside it;
(c) documents per second vs the transformers reference backend, 1 and N concurrent documents;
(d) WiM wall time vs one plain long-context call with the same answer length, and the share of
    WiM's wall time that grounding its margins took.

Absolute seconds depend on the machine and its load; the ratios are the result. Repeated
measurements alternate between the two sides so that drifting load hits both alike, and the
ratios of (b) and (d) are also printed as the mean of their rounds with a 95% t-interval
(`intervals.py`), so that two runs can be told apart from noise.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from dataclasses import asdict
from typing import Any

from wim_service.benchmarks.common import QUERIES, BenchSettings, JobResult, line, timed_job
from wim_service.benchmarks.intervals import RoundsInterval, t_interval
from wim_service.wim.backend import RequestKind
from wim_service.wim.grounding import SegmentText, query_overlap
from wim_service.wim.notes import NotePolicy
from wim_service.wim.options import WiMOptions
from wim_service.wim.prompts import PromptBuilder
from wim_service.wim.segmentation import Segment, leading_sentences


async def plain_call(
    backend: Any, document: str, query: str, options: WiMOptions, tokens: int
) -> float:
    """One plain long-context request (document + query), forced to `tokens` answer tokens."""
    builder = PromptBuilder(backend.tokenizer, options.prompts)
    ids = builder.plain_prompt(backend.tokenizer.encode_user_text(document).ids, query)
    # A fresh salt: the same document was read in earlier rounds, and a cache hit would make
    # the plain side look cheaper than a first read is.
    completion = await backend.complete(
        ids, max_tokens=tokens, exact_tokens=True, cache_salt=secrets.token_hex(8)
    )
    return completion.seconds


def grounding_seconds(document: str, query: str, job: JobResult, options: WiMOptions) -> float:
    """The time grounding took in `job`, replayed as the orchestrator runs it: every segment
    split into sentences (a fresh `SegmentText`) and, with `skip_unmatched_segments`, its
    windows scored against the query; every margin written guessed for the early answer (its
    segment's `closest_sentence`, as if it were still running at the last push), checked
    while it is written (its sentences counted and `cannot_keep` on every prefix of it, more
    calls than it had tokens) and at its end, then the query-overlap score of its note. It
    runs on the job's event loop, beside the engine, so this is an upper bound on what it adds
    to the job's wall time."""
    policy = NotePolicy.of(options)
    started = time.perf_counter()
    for margin in job.margins:
        segment = Segment(margin.segment, 0, 0, margin.char_start, margin.char_end)
        segment_text = SegmentText(document, segment)
        if policy.none_can_be_kept(segment_text, query):
            continue
        segment_text.closest_sentence(query)
        for end in range(len(margin.text) + 1):
            if options.margin_max_sentences:
                leading_sentences(margin.text[:end], options.margin_max_sentences)
            policy.cannot_keep(segment_text, margin.text[:end], query)
        grounding = segment_text.ground(
            margin.text,
            min_coverage=options.grounding_min_coverage,
            max_sentences=options.grounding_max_sentences,
        )
        query_overlap(query, grounding.evidence.text if grounding.evidence else margin.text)
    return time.perf_counter() - started


async def bench_tokens(backend: Any, document: str, options: WiMOptions) -> dict[str, Any]:
    job = await timed_job(backend, document, QUERIES[0], options)
    u = job.done.usage
    block = backend.limits.block_size
    return {
        "segments": u.segments,
        "context_tokens": u.context_tokens,
        "computed": u.prompt_tokens_computed,
        "minimal": u.minimal_prompt_tokens,
        "excess": u.excess_computed_tokens,
        "excess_blocks": u.excess_computed_tokens / block,
        "ratio": u.prompt_tokens_computed / u.minimal_prompt_tokens,
    }


def _hideable(seconds: list[float]) -> float:
    """All but the longest: the margins left when the last push is done decode together, so
    the tail is at least one margin's time."""
    return sum(seconds) - max(seconds, default=0.0)


async def bench_pipeline(
    backend: Any, document: str, options: WiMOptions, rounds: int
) -> dict[str, Any]:
    """Pipelined vs sequential, and two overlap limits from the sequential run's margins.

    The engine's request timeline splits each margin into its prefill (to the first token)
    and its decode. Pipelining puts a margin's prefill in the same engine step as the next
    segment's push, where it still costs its compute: on a compute-bound CPU only the decode
    steps (one token per margin, bound by reading the weights) can ride along for free. So
    `overlap_limit` hides every margin's decode but the longest; `overlap_limit_whole_margins`
    hides whole margins, a bound only an engine with idle compute during prefill can reach.

    Each round's limit belongs to its own query (a query that writes one margin or none has
    nothing to hide: limit 1), so the goal is judged round by round: `ratio_to_limit` is the
    median of each round's pipelined time over its limit's time, at most 1 when pipelining
    reaches the limit. The medians of the ratios and of the limits, taken apart, may pair one
    query's ratio with another's limit.
    """
    pipelined: list[float] = []
    sequential: list[float] = []
    limits: list[float] = []
    whole: list[float] = []
    for r in range(rounds):
        query = QUERIES[r % len(QUERIES)]
        # The side that runs first alternates: the second job of a round meets the engine as
        # the first left it.
        pipe = (
            None
            if r % 2 == 0
            else await timed_job(backend, document, query, options, pipelined=True)
        )
        mark = time.monotonic()
        seq = await timed_job(backend, document, query, options, pipelined=False)
        spans = [s for s in backend.timeline if s.started >= mark and s.kind == RequestKind.MARGIN]
        pipe = pipe or await timed_job(backend, document, query, options, pipelined=True)
        sequential.append(seq.seconds)
        pipelined.append(pipe.seconds)
        decode = [s.ended - s.first_output for s in spans if s.first_output and s.ended]
        limits.append((seq.seconds - _hideable(decode)) / seq.seconds)
        whole.append((seq.seconds - _hideable([m.elapsed_s for m in seq.margins])) / seq.seconds)
    ratios = [p / s for p, s in zip(pipelined, sequential, strict=True)]
    to_limit = [ratio / limit for ratio, limit in zip(ratios, limits, strict=True)]
    return {
        "pipelined_s": statistics.median(pipelined),
        "sequential_s": statistics.median(sequential),
        "ratio": statistics.median(ratios),
        "ratio_interval": asdict(t_interval(ratios)),
        "overlap_limit": statistics.median(limits),
        "overlap_limit_whole_margins": statistics.median(whole),
        "ratio_to_limit": statistics.median(to_limit),
        "ratio_to_limit_interval": asdict(t_interval(to_limit)),
        "rounds": [
            {"query": QUERIES[r % len(QUERIES)], "ratio": ratio, "overlap_limit": limit}
            for r, (ratio, limit) in enumerate(zip(ratios, limits, strict=True))
        ],
    }


async def docs_per_second(backend: Any, document: str, options: WiMOptions, n: int) -> float:
    started = time.perf_counter()
    await asyncio.gather(
        *(timed_job(backend, document, QUERIES[i % len(QUERIES)], options) for i in range(n))
    )
    return n / (time.perf_counter() - started)


async def bench_vs_plain(
    backend: Any, document: str, options: WiMOptions, rounds: int
) -> dict[str, Any]:
    wim_s: list[float] = []
    plain_s: list[float] = []
    grounding_s: list[float] = []
    for r in range(rounds):
        query = QUERIES[r % len(QUERIES)]
        job = await timed_job(backend, document, query, options)
        tokens = max(job.done.usage.answer_tokens, 1)
        plain_s.append(await plain_call(backend, document, query, options, tokens))
        wim_s.append(job.seconds)
        grounding_s.append(grounding_seconds(document, query, job, options))
    ratios = [w / p for w, p in zip(wim_s, plain_s, strict=True)]
    return {
        "wim_s": statistics.median(wim_s),
        "plain_s": statistics.median(plain_s),
        "ratio": statistics.median(ratios),
        "ratio_interval": asdict(t_interval(ratios)),
        "grounding_s": statistics.median(grounding_s),
        "grounding_share": statistics.median(
            g / w for g, w in zip(grounding_s, wim_s, strict=True)
        ),
        "rounds": [
            {"query": QUERIES[r % len(QUERIES)], "ratio": ratio} for r, ratio in enumerate(ratios)
        ],
    }


async def docs_per_second_at(
    backend: Any, document: str, options: WiMOptions, concurrency: int
) -> dict[str, float]:
    """Documents per second with 1 and with `concurrency` documents at once."""
    return {
        "1": await docs_per_second(backend, document, options, 1),
        str(concurrency): await docs_per_second(backend, document, options, concurrency),
    }


def _print_tokens(cached: dict[str, Any]) -> None:
    line("segments / context tokens", f"{cached['segments']} / {cached['context_tokens']}")
    line(
        "computed - minimal (prefix caching on)",
        f"{cached['excess']} tokens = {cached['excess_blocks']:.2f} blocks; "
        f"ratio {cached['ratio']:.3f}",
    )


def _print_pipeline(pipe: dict[str, Any]) -> None:
    line(
        "pipelined / sequential (median of rounds)",
        f"{pipe['pipelined_s']:.2f} s / {pipe['sequential_s']:.2f} s = {pipe['ratio']:.3f} "
        f"(overlap limit {pipe['overlap_limit']:.3f}: margins' decode hidden; "
        f"{pipe['overlap_limit_whole_margins']:.3f}: whole margins hidden)",
    )
    line("pipelined / sequential, mean of rounds", str(RoundsInterval(**pipe["ratio_interval"])))
    line(
        "pipelined / its round's limit (median of rounds)",
        f"{pipe['ratio_to_limit']:.3f} (at most 1: the overlap limit is reached)",
    )
    line(
        "pipelined / its round's limit, mean of rounds",
        str(RoundsInterval(**pipe["ratio_to_limit_interval"])),
    )


def _print_vs_plain(plain: dict[str, Any]) -> None:
    line(
        "WiM / plain (median of rounds)",
        f"{plain['wim_s']:.2f} s / {plain['plain_s']:.2f} s = {plain['ratio']:.3f}",
    )
    line("WiM / plain, mean of rounds", str(RoundsInterval(**plain["ratio_interval"])))
    line(
        "grounding / WiM wall time",
        f"{plain['grounding_s'] * 1000:.1f} ms / {plain['wim_s']:.2f} s = "
        f"{plain['grounding_share']:.2%}",
    )


async def _with_prefix_caching(
    backend: Any, document: str, settings: BenchSettings
) -> dict[str, Any]:
    """(a), (b), (d) and vLLM's side of (c), on the engine as it runs in the service."""
    options = settings.options
    results: dict[str, Any] = {}
    await timed_job(backend, document, QUERIES[0], options)  # warm-up
    print("(a) prompt tokens computed beyond the minimum", flush=True)
    results["a_prefix_caching"] = await bench_tokens(backend, document, options)
    _print_tokens(results["a_prefix_caching"])
    print("(b) pipelined vs sequential wall time", flush=True)
    results["b_pipeline"] = await bench_pipeline(backend, document, options, settings.rounds)
    _print_pipeline(results["b_pipeline"])
    print("(d) WiM vs one plain long-context call, same answer length", flush=True)
    results["d_vs_plain"] = await bench_vs_plain(backend, document, options, settings.rounds)
    _print_vs_plain(results["d_vs_plain"])
    if not settings.skip_reference:
        results["c_vllm_docs_per_s"] = await docs_per_second_at(
            backend, document, options, settings.concurrency
        )
    return results


def _print_reference(
    settings: BenchSettings, fast: dict[str, float], ref: dict[str, float]
) -> None:
    for n in ("1", str(settings.concurrency)):
        line(
            f"{n} document(s) at once: vLLM / reference",
            f"{fast[n]:.3f} / {ref[n]:.3f} docs/s = {fast[n] / ref[n]:.2f}x",
        )


async def run_bench(settings: BenchSettings) -> int:
    from wim_service.engine.hf_backend import HFBackend
    from wim_service.engine.vllm_engine import VLLMBackend

    document = settings.document()
    options = settings.options
    results: dict[str, Any] = {"command": "wim bench " + " ".join(_argv(settings))}
    settings.header("wim bench")

    # Jobs wait for KV room instead of being refused: (c) submits all documents at once.
    patient = settings.engine.model_copy(update={"admission_timeout_s": 3600.0})
    backend = VLLMBackend.start(patient)
    try:
        results.update(await _with_prefix_caching(backend, document, settings))
    finally:
        backend.shutdown()

    backend = VLLMBackend.start(patient.model_copy(update={"enable_prefix_caching": False}))
    try:
        uncached = await bench_tokens(backend, document, options)
        results["a_no_prefix_caching"] = uncached
        line(
            "computed - minimal (prefix caching off)",
            f"{uncached['excess']} tokens; ratio {uncached['ratio']:.3f}",
        )
    finally:
        backend.shutdown()

    if not settings.skip_reference:
        print("(c) documents per second vs the transformers reference backend", flush=True)
        reference = HFBackend.from_config(settings.engine)
        ref = await docs_per_second_at(reference, document, options, settings.concurrency)
        results["c_reference_docs_per_s"] = ref
        _print_reference(settings, results["c_vllm_docs_per_s"], ref)
    settings.save(results)
    return 0


def _argv(settings: BenchSettings) -> list[str]:
    options = [f"--options {settings.options_file}"] if settings.options_file else []
    return [
        f"--repeat {settings.repeat}",
        f"--segment-tokens {settings.options.segment_tokens}",
        f"--relevance {settings.options.relevance}",
        *options,
        f"--concurrency {settings.concurrency}",
        f"--rounds {settings.rounds}",
        *settings.engine.cli_argv(),
    ]
