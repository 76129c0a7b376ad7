"""`wim bench`: WiM cost ratios, each measured side by side in one run on one machine.

(a) prompt tokens computed beyond the minimum, with prefix caching on and off;
(b) pipelined vs sequential wall time, with the overlap limit beside it;
(c) documents per second vs the transformers reference backend, 1 and N concurrent documents;
(d) WiM wall time vs one plain long-context call with the same answer length.

Absolute seconds depend on the machine and its load; the ratios are the result. Repeated
measurements alternate between the two sides so that drifting load hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wim_service.wim.backend import Backend
from wim_service.wim.events import DoneEvent, MarginEvent
from wim_service.wim.options import WiMOptions
from wim_service.wim.orchestrator import run_wim
from wim_service.wim.prompts import PromptBuilder

DEFAULT_DOCUMENT = Path(__file__).resolve().parent.parent / "examples" / "harbor_report.txt"
QUERIES = [
    "What is the access code for the night gate?",
    "Who replaced Margaret Oyelaran as head of the pilot service?",
    "How many passengers did the ferry to the islands carry?",
    "When is the harbour office open?",
    "How many boats are registered at the port?",
    "What will happen to the old warehouse on the north quay?",
    "How many apprentices trained at the port this year?",
    "What did the auditors find?",
]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        type=Path,
        default=DEFAULT_DOCUMENT,
        help="document to read (default: the sample report, repeated --repeat times)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="copies of the document to join")
    parser.add_argument("--segment-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8, help="documents at once for (c)")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions for (b) and (d)")
    parser.add_argument(
        "--skip-reference", action="store_true", help="skip (c), the transformers baseline"
    )
    parser.add_argument("--json-out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--serving",
        action="store_true",
        help="benchmark the HTTP service instead (local Ray, REST vs in-process, sessions)",
    )


@dataclass
class JobResult:
    seconds: float
    done: DoneEvent
    margins: list[MarginEvent] = field(default_factory=list)


async def timed_job(
    backend: Backend, document: str, query: str, options: WiMOptions, *, pipelined: bool = True
) -> JobResult:
    started = time.perf_counter()
    margins: list[MarginEvent] = []
    done: DoneEvent | None = None
    async for event in run_wim(
        backend, backend.tokenizer, document, query, options, pipelined=pipelined
    ):
        if event.type == "margin":
            margins.append(event)
        elif event.type == "done":
            done = event
        elif event.type == "error":
            raise RuntimeError(f"benchmark job failed: {event.code}: {event.message}")
    assert done is not None
    return JobResult(time.perf_counter() - started, done, margins)


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


def _line(label: str, value: str) -> None:
    print(f"  {label:<58} {value}", flush=True)


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


async def bench_pipeline(
    backend: Any, document: str, options: WiMOptions, rounds: int
) -> dict[str, Any]:
    pipelined: list[float] = []
    sequential: list[float] = []
    limits: list[float] = []
    for r in range(rounds):
        query = QUERIES[r % len(QUERIES)]
        seq = await timed_job(backend, document, query, options, pipelined=False)
        pipe = await timed_job(backend, document, query, options, pipelined=True)
        sequential.append(seq.seconds)
        pipelined.append(pipe.seconds)
        # Pipelining can hide every margin's decode except the last one's.
        margin_times = sorted(m.elapsed_s for m in seq.margins)
        hideable = sum(margin_times) - (margin_times[-1] if margin_times else 0.0)
        limits.append((seq.seconds - hideable) / seq.seconds)
    ratio = statistics.median(p / s for p, s in zip(pipelined, sequential, strict=True))
    return {
        "pipelined_s": statistics.median(pipelined),
        "sequential_s": statistics.median(sequential),
        "ratio": ratio,
        "overlap_limit": statistics.median(limits),
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
    for r in range(rounds):
        query = QUERIES[r % len(QUERIES)]
        job = await timed_job(backend, document, query, options)
        tokens = max(job.done.usage.answer_tokens, 1)
        plain_s.append(await plain_call(backend, document, query, options, tokens))
        wim_s.append(job.seconds)
    return {
        "wim_s": statistics.median(wim_s),
        "plain_s": statistics.median(plain_s),
        "ratio": statistics.median(w / p for w, p in zip(wim_s, plain_s, strict=True)),
    }


async def run_bench(args: argparse.Namespace) -> int:
    from wim_service.engine.config import EngineConfig
    from wim_service.engine.hf_backend import HFBackend
    from wim_service.engine.vllm_engine import VLLMBackend

    text = args.context.read_text(encoding="utf-8")
    document = "\n\n".join([text] * args.repeat)
    options = WiMOptions(segment_tokens=args.segment_tokens)
    results: dict[str, Any] = {"command": "wim bench " + " ".join(_argv(args))}
    print(
        f"wim bench: {args.context.name} x{args.repeat}, segments of ~{args.segment_tokens} "
        f"tokens, dtype {args.dtype}",
        flush=True,
    )

    # Jobs wait for KV room instead of being refused: (c) submits all documents at once.
    backend = VLLMBackend.start(EngineConfig.from_cli_args(args, admission_timeout_s=3600.0))
    try:
        await timed_job(backend, document, QUERIES[0], options)  # warm-up
        print("(a) prompt tokens computed beyond the minimum", flush=True)
        cached = await bench_tokens(backend, document, options)
        results["a_prefix_caching"] = cached
        _line("segments / context tokens", f"{cached['segments']} / {cached['context_tokens']}")
        _line(
            "computed - minimal (prefix caching on)",
            f"{cached['excess']} tokens = {cached['excess_blocks']:.2f} blocks; "
            f"ratio {cached['ratio']:.3f}",
        )
        print("(b) pipelined vs sequential wall time", flush=True)
        pipe = await bench_pipeline(backend, document, options, args.rounds)
        results["b_pipeline"] = pipe
        _line(
            "pipelined / sequential",
            f"{pipe['pipelined_s']:.2f} s / {pipe['sequential_s']:.2f} s = {pipe['ratio']:.3f} "
            f"(overlap limit {pipe['overlap_limit']:.3f})",
        )
        print("(d) WiM vs one plain long-context call, same answer length", flush=True)
        plain = await bench_vs_plain(backend, document, options, args.rounds)
        results["d_vs_plain"] = plain
        _line(
            "WiM / plain",
            f"{plain['wim_s']:.2f} s / {plain['plain_s']:.2f} s = {plain['ratio']:.3f}",
        )
        if not args.skip_reference:
            results["c_vllm_docs_per_s"] = {
                "1": await docs_per_second(backend, document, options, 1),
                str(args.concurrency): await docs_per_second(
                    backend, document, options, args.concurrency
                ),
            }
    finally:
        backend.shutdown()

    backend = VLLMBackend.start(
        EngineConfig.from_cli_args(args, enable_prefix_caching=False, admission_timeout_s=3600.0)
    )
    try:
        uncached = await bench_tokens(backend, document, options)
        results["a_no_prefix_caching"] = uncached
        _line(
            "computed - minimal (prefix caching off)",
            f"{uncached['excess']} tokens; ratio {uncached['ratio']:.3f}",
        )
    finally:
        backend.shutdown()

    if not args.skip_reference:
        print("(c) documents per second vs the transformers reference backend", flush=True)
        reference = HFBackend.from_config(EngineConfig.from_cli_args(args))
        ref = {
            "1": await docs_per_second(reference, document, options, 1),
            str(args.concurrency): await docs_per_second(
                reference, document, options, args.concurrency
            ),
        }
        results["c_reference_docs_per_s"] = ref
        fast = results["c_vllm_docs_per_s"]
        for n in ("1", str(args.concurrency)):
            _line(
                f"{n} document(s) at once: vLLM / reference",
                f"{fast[n]:.3f} / {ref[n]:.3f} docs/s = {fast[n] / ref[n]:.2f}x",
            )
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    return [
        f"--repeat {args.repeat}",
        f"--segment-tokens {args.segment_tokens}",
        f"--concurrency {args.concurrency}",
        f"--rounds {args.rounds}",
        f"--dtype {args.dtype}",
    ]
