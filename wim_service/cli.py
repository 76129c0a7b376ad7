"""`wim`: run WiM on a document from the command line, benchmark it, prepare offline assets.

wim run --context examples/harbor_report.txt --query "What is the night gate code?"
wim run --context doc.txt --query "..." --json --relevance classifier
wim bench                      # the side-by-side benchmark of docs/benchmarks.md
wim setup                      # convert the default model, write the punkt data
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from wim_service.engine.config import EngineConfig
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import RelevanceMode, WiMOptions


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from wim_service.benchmarks.common import DEFAULT_DOCUMENT

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wim", description="Writing-in-the-Margins long-document question answering."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="answer a query about a document")
    run.add_argument("--context", required=True, type=Path, help="the document (UTF-8 text)")
    run.add_argument("--query", required=True, help="the question")
    run.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    run.add_argument(
        "--relevance",
        choices=[m.value for m in RelevanceMode],
        default=RelevanceMode.FIRST_TOKEN.value,
        help="how margins are judged (%(default)s)",
    )
    run.add_argument("--segment-tokens", type=int, default=WiMOptions().segment_tokens)
    run.add_argument(
        "--options", type=Path, help="JSON file with further WiMOptions (prompts, limits)"
    )
    run.add_argument(
        "--backend",
        choices=["vllm", "reference"],
        default="vllm",
        help="vllm engine, or the plain-transformers reference backend",
    )
    EngineConfig.add_cli_args(run)

    bench = commands.add_parser("bench", help="benchmark ratios, measured side by side")
    add_bench_arguments(bench)
    EngineConfig.add_cli_args(bench)

    evaluate = commands.add_parser(
        "eval", help="answer-quality evaluation: plain long context vs RAG vs WiM"
    )
    from wim_service.eval.cli import add_eval_arguments

    add_eval_arguments(evaluate)
    EngineConfig.add_cli_args(evaluate)

    serve = commands.add_parser(
        "serve",
        help="run the HTTP service on local Ray (Ray Serve's `serve run` with our environment)",
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_SERVE_CONFIG,
        help="Ray Serve config file (default: %(default)s)",
    )

    commands.add_parser("setup", help="prepare the offline default model and punkt data")
    return parser


DEFAULT_SERVE_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve_config.yaml"


def _serve(config: Path) -> int:
    """Replace this process with `serve run CONFIG`, so the config's deployments apply."""
    from wim_service.assets.default_model import default_model_dir
    from wim_service.assets.punkt import punkt_data_dir

    # Prepare the offline assets once here rather than in every replica at once.
    default_model_dir()
    punkt_data_dir()
    env = {
        **os.environ,
        # Ray starts workers at nice 15 and the engines would inherit it.
        "RAY_worker_niceness": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    serve = Path(sys.executable).with_name("serve")
    os.execve(serve, [str(serve), "run", str(config)], env)
    return 0  # not reached


def _options(args: argparse.Namespace) -> WiMOptions:
    extra = json.loads(args.options.read_text()) if args.options else {}
    extra.setdefault("relevance", args.relevance)
    extra.setdefault("segment_tokens", args.segment_tokens)
    return WiMOptions.model_validate(extra)


def start_backend(args: argparse.Namespace) -> Any:
    config = EngineConfig.from_cli_args(args)
    if getattr(args, "backend", "vllm") == "reference":
        from wim_service.engine.hf_backend import HFBackend

        return HFBackend.from_config(config)
    from wim_service.engine.vllm_engine import VLLMBackend

    return VLLMBackend.start(config)


async def _collect(events: AsyncIterator[WiMEvent]) -> dict[str, Any]:
    result: dict[str, Any] = {"margins": []}
    async for event in events:
        if event.type == "margin":
            result["margins"].append(
                {"segment": event.segment, "text": event.text, "relevant": event.relevant}
            )
        elif event.type == "done":
            result.update(
                answer=event.answer,
                usage=event.usage.model_dump(),
                timings=event.timings.model_dump(),
            )
        elif event.type == "error":
            result["error"] = {"code": event.code, "message": event.message}
    result["margins"].sort(key=lambda m: m["segment"])
    return result


async def _show(events: AsyncIterator[WiMEvent]) -> int:
    """Progress bar per segment, margins as they are written, then the streamed answer."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    out = Console()
    progress = Progress(
        TextColumn("reading"), BarColumn(), MofNCompleteColumn(), console=console, transient=True
    )
    task = None
    status = 0
    with progress:
        async for event in events:
            if event.type == "segment":
                if task is None:
                    task = progress.add_task("segments", total=event.segments)
                progress.update(task, completed=event.segment + 1)
            elif event.type == "margin":
                mark = "[green]kept[/]" if event.relevant else "[dim]dropped[/]"
                text = event.text or "(no relevant fact)"
                progress.console.print(f"[bold]margin {event.segment + 1}[/] {mark}: {text}")
            elif event.type == "answer":
                if task is not None:
                    progress.stop()
                    progress.remove_task(task)
                    task = None
                    out.print("[bold]answer:[/] ", end="")
                out.print(event.text, end="", markup=False, highlight=False)
            elif event.type == "done":
                out.print()
                u = event.usage
                console.print(
                    f"[dim]{u.segments} segments, {u.context_tokens} context tokens, "
                    f"{u.prompt_tokens_computed} prompt tokens computed "
                    f"({u.prompt_tokens_cached} from cache), {event.timings.total_s:.1f} s[/]"
                )
            elif event.type == "error":
                console.print(f"[red]error ({event.code}):[/] {event.message}")
                status = 1
    return status


async def _run(args: argparse.Namespace) -> int:
    from wim_service.wim.orchestrator import run_wim

    document = args.context.read_text(encoding="utf-8")
    options = _options(args)
    backend = start_backend(args)
    try:
        events = run_wim(backend, backend.tokenizer, document, args.query, options)
        if args.json:
            result = await _collect(events)
            print(json.dumps(result, indent=2))
            return 1 if "error" in result else 0
        return await _show(events)
    finally:
        if hasattr(backend, "shutdown"):
            backend.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "setup":
        from wim_service.assets.default_model import default_model_dir
        from wim_service.assets.punkt import punkt_data_dir

        print(f"default model: {default_model_dir()}")
        print(f"punkt data:    {punkt_data_dir()}")
        return 0
    if args.command == "run":
        try:
            return asyncio.run(_run(args))
        except (OSError, ValueError) as exc:
            print(f"wim: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return _serve(args.config)
    if args.command == "eval":
        from wim_service.eval.cli import run_eval

        return asyncio.run(run_eval(args))
    from wim_service.benchmarks.common import BenchSettings

    settings = BenchSettings(
        context=args.context,
        repeat=args.repeat,
        segment_tokens=args.segment_tokens,
        concurrency=args.concurrency,
        rounds=args.rounds,
        skip_reference=args.skip_reference,
        json_out=args.json_out,
        engine=EngineConfig.from_cli_args(args),
    )
    if args.serving:
        from wim_service.benchmarks.service import run_serving_bench

        return asyncio.run(run_serving_bench(settings))
    from wim_service.benchmarks.engine import run_bench

    return asyncio.run(run_bench(settings))


if __name__ == "__main__":
    sys.exit(main())
