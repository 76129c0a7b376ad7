"""`wim eval`: plain long context vs RAG vs WiM on generated long-context tasks.

wim eval                       # smoke size: one task per kind at 1024 tokens, every method
wim eval --full                # 36 tasks per kind: 4 per length at 1k, 2k, 4k tokens, 3 seeds
wim eval --full --model DIR --max-model-len 65536 --lengths 16384 32384 64000
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from wim_service.assets.default_model import default_model_dir
from wim_service.cli.lifecycle import refused, run_command
from wim_service.cli.run import read_options
from wim_service.engine.config import EngineConfig
from wim_service.eval.methods import METHODS, MethodSettings
from wim_service.eval.report import write_report
from wim_service.eval.runner import RunRecord, evaluate
from wim_service.eval.sizing import WindowTooSmall, largest_length
from wim_service.eval.tasks import TaskKind, generate_tasks
from wim_service.wim.options import WiMOptions
from wim_service.wim.tokenizer import HFTokenizer, Tokenizer

# The default model's practical lengths: at 6.6k tokens every method degenerates on it.
FULL_LENGTHS = [1024, 2048, 4096]
FULL_SAMPLES = 4
FULL_SEEDS = [0, 1, 2]
SMOKE_LENGTHS = [1024]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "eval", help="answer-quality evaluation: plain long context vs RAG vs WiM"
    )
    size = parser.add_argument_group("size")
    size.add_argument(
        "--full",
        action="store_true",
        help=f"full size: {FULL_SAMPLES} tasks per kind and length at {FULL_LENGTHS} tokens, "
        f"seeds {FULL_SEEDS} (default: smoke size, 1 task per kind at 1024, seed 0)",
    )
    size.add_argument("--lengths", type=int, nargs="+", help="document lengths in model tokens")
    size.add_argument("--samples", type=int, help="tasks per kind and length")
    size.add_argument(
        "--kinds",
        nargs="+",
        choices=[k.value for k in TaskKind],
        default=[k.value for k in TaskKind],
    )
    size.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    size.add_argument(
        "--seeds", type=int, nargs="+", help="task generator seeds, pooled (default: 0)"
    )
    knobs = parser.add_argument_group("methods")
    knobs.add_argument(
        "--segment-tokens", type=int, help="WiM segment size (default: WiMOptions' default)"
    )
    knobs.add_argument(
        "--options",
        type=Path,
        help="JSON file with WiMOptions (prompts, limits) for every method; the fields it sets "
        "win over --segment-tokens",
    )
    knobs.add_argument("--rag-chunk-tokens", type=int, default=MethodSettings.rag_chunk_tokens)
    knobs.add_argument("--rag-top-k", type=int, default=MethodSettings.rag_top_k)
    parser.add_argument(
        "--out", type=Path, default=Path("eval_results"), help="output folder (%(default)s)"
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    return run_command(_run(args))


def _lengths(
    args: argparse.Namespace, max_model_len: int, options: WiMOptions, tokenizer: Tokenizer
) -> list[int]:
    longest = largest_length(max_model_len, options, tokenizer)
    if args.lengths:
        too_long = [n for n in args.lengths if n > longest]
        if too_long:
            raise WindowTooSmall(
                f"lengths {too_long} do not fit a {max_model_len}-token window with WiM's "
                f"margins; the longest that fits is {longest}"
            )
        return sorted(args.lengths)
    if args.full:
        return [n for n in FULL_LENGTHS if n <= longest] or [longest]
    return [min(n, longest) for n in SMOKE_LENGTHS]


def _show(total: int) -> Callable[[RunRecord], None]:
    """Print one line per finished run: a long evaluation shows its progress as it goes."""
    done = 0

    def show(record: RunRecord) -> None:
        nonlocal done
        done += 1
        answer = record.result.error or record.result.answer.replace("\n", " ")
        print(
            f"[{done:>4}/{total}] {record.task_id:<22} {record.method:<16} "
            f"score {record.score:.2f}  {record.result.wall_s:6.1f} s  {answer[:70]}",
            flush=True,
        )

    return show


async def _run(args: argparse.Namespace) -> int:
    try:
        options = read_options(args.options, segment_tokens=args.segment_tokens)
    except (OSError, ValueError) as exc:  # an unreadable or invalid --options file
        return refused(exc)
    from wim_service.engine.vllm_engine import VLLMBackend  # seconds to import: after the check

    config = EngineConfig.from_cli_args(args)
    tokenizer = HFTokenizer(config.model or default_model_dir())
    try:
        lengths = _lengths(args, config.max_model_len, options, tokenizer)
    except WindowTooSmall as exc:
        return refused(exc)
    samples = args.samples or (FULL_SAMPLES if args.full else 1)
    seeds = args.seeds or (FULL_SEEDS if args.full else [0])
    settings = MethodSettings(options, args.rag_chunk_tokens, args.rag_top_k)
    backend = VLLMBackend.start(config)
    try:
        tasks = [
            task
            for seed in seeds
            for task in generate_tasks(
                backend.tokenizer,
                kinds=[TaskKind(k) for k in args.kinds],
                lengths=lengths,
                samples=samples,
                seed=seed,
            )
        ]
        print(
            f"wim eval: {len(tasks)} tasks x {len(args.methods)} methods, lengths {lengths}, "
            f"seeds {seeds}",
            flush=True,
        )
        records = await evaluate(
            backend, tasks, args.methods, settings, _show(len(tasks) * len(args.methods))
        )
    finally:
        backend.shutdown()
    model = Path(config.model).name if config.model else "SmolLM2-135M-Instruct (default)"
    run_config = {
        "command": "wim " + " ".join(sys.argv[1:]),
        "model": model,
        "engine": config.model_dump(),
        "lengths": lengths,
        "samples": samples,
        "seeds": seeds,
        "methods": args.methods,
        "wim_options": options.model_dump(mode="json"),
        "rag": {"chunk_tokens": settings.rag_chunk_tokens, "top_k": settings.rag_top_k},
    }
    title = f"wim eval: {model}, {config.dtype_label()}"
    paths = write_report(records, args.out, run_config, title=title)
    print(paths["markdown"].read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
