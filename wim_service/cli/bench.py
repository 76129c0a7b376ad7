"""`wim bench`: the engine benchmark, or with `--serving` the service benchmark, `--store` the
session store's, `--kv-restore` a restore against a re-read (docs/benchmarks.md); all in
`wim_service.benchmarks`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wim_service.benchmarks.common import DEFAULT_DOCUMENT, BenchSettings
from wim_service.cli.lifecycle import refused, run_command
from wim_service.cli.run import add_relevance_argument, read_options
from wim_service.engine.config import EngineConfig


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="benchmark ratios, measured side by side")
    parser.add_argument(
        "--context",
        type=Path,
        default=DEFAULT_DOCUMENT,
        help="document to read (default: the sample report, repeated --repeat times)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="copies of the document to join")
    parser.add_argument("--segment-tokens", type=int, default=512)
    add_relevance_argument(parser)
    parser.add_argument(
        "--options",
        type=Path,
        help="JSON file with further WiMOptions (prompts, limits) for every WiM job; the fields "
        "it sets win over --segment-tokens and --relevance",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="documents at once for (c)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repetitions for (b) and (d); each of their ratios is printed as the median of the "
        "rounds and as their mean with a 95%% Student's t-interval (2 rounds at the least)",
    )
    parser.add_argument(
        "--skip-reference", action="store_true", help="skip (c), the transformers baseline"
    )
    parser.add_argument("--json-out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--serving",
        action="store_true",
        help="benchmark the HTTP service instead (local Ray, REST vs in-process, sessions)",
    )
    parser.add_argument(
        "--store",
        action="store_true",
        help="benchmark the session store instead (in-process vs Redis, routers agreeing)",
    )
    parser.add_argument(
        "--kv-restore",
        action="store_true",
        help="benchmark restoring a document's stored KV against re-reading it instead "
        "(a temporary KV store; --rounds rounds)",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(main=main)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(
        context=args.context,
        repeat=args.repeat,
        options=read_options(
            args.options, segment_tokens=args.segment_tokens, relevance=args.relevance
        ),
        options_file=args.options,
        concurrency=args.concurrency,
        rounds=args.rounds,
        skip_reference=args.skip_reference,
        json_out=args.json_out,
        engine=EngineConfig.from_cli_args(args),
    )


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except (OSError, ValueError) as exc:  # an unreadable or invalid --options file
        return refused(exc)
    if args.kv_restore:
        from wim_service.benchmarks.restore import run_restore_bench

        return run_command(run_restore_bench(settings))
    if args.store:
        from wim_service.benchmarks.store import NoRedis, run_store_bench

        try:
            return run_command(run_store_bench())
        except NoRedis as exc:
            print(f"wim bench: {exc}", file=sys.stderr)
            return 1
    if args.serving:
        from wim_service.benchmarks.service import run_serving_bench

        return run_command(run_serving_bench(settings))
    from wim_service.benchmarks.engine import run_bench

    return run_command(run_bench(settings))
