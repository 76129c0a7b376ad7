"""`wim run`: answer a query about a document in-process (no Ray), with progress or as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from wim_service.cli.lifecycle import refused, run_command
from wim_service.engine.config import EngineConfig
from wim_service.wim.backend import Backend
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import RelevanceMode, WiMOptions


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("run", help="answer a query about a document")
    parser.add_argument("--context", required=True, type=Path, help="the document (UTF-8 text)")
    parser.add_argument("--query", required=True, help="the question")
    parser.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    add_relevance_argument(parser)
    parser.add_argument("--segment-tokens", type=int, default=WiMOptions().segment_tokens)
    parser.add_argument(
        "--options", type=Path, help="JSON file with further WiMOptions (prompts, limits)"
    )
    parser.add_argument(
        "--backend",
        choices=["vllm", "reference"],
        default="vllm",
        help="vllm engine, or the plain-transformers reference backend",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(main=main)


def add_relevance_argument(parser: argparse.ArgumentParser) -> None:
    """`--relevance`, defaulting to WiMOptions' own (`wim run` and `wim bench`)."""
    parser.add_argument(
        "--relevance",
        choices=[m.value for m in RelevanceMode],
        default=WiMOptions().relevance.value,
        help="how margins are judged (%(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        return run_command(_run(args))
    except (OSError, ValueError) as exc:
        return refused(exc)


def read_options(path: Path | None, **flags: Any) -> WiMOptions:
    """WiMOptions from a JSON file (`--options` of `wim run`, `wim bench` and `wim eval`), the
    flags filling what the file does not set (a flag given as None is not set)."""
    fields = json.loads(path.read_text()) if path else {}
    for name, value in flags.items():
        if value is not None:
            fields.setdefault(name, value)
    return WiMOptions.model_validate(fields)


def _start_backend(args: argparse.Namespace) -> Backend:
    config = EngineConfig.from_cli_args(args)
    if args.backend == "reference":
        from wim_service.engine.hf_backend import HFBackend

        return HFBackend.from_config(config)
    from wim_service.engine.vllm_engine import VLLMBackend

    return VLLMBackend.start(config)


async def _collect(events: AsyncIterator[WiMEvent]) -> dict[str, Any]:
    result: dict[str, Any] = {"margins": []}
    async for event in events:
        if event.type == "margin":
            result["margins"].append(
                {
                    "segment": event.segment,
                    "text": event.text,
                    "relevant": event.relevant,
                    "grounded": event.grounded,
                    "cut_short": event.cut_short,
                    "skipped": event.skipped,
                    "kept": event.kept,
                    "evidence": event.evidence,
                }
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
                mark = "[green]kept[/]" if event.kept else "[dim]dropped[/]"
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
    options = read_options(
        args.options, relevance=args.relevance, segment_tokens=args.segment_tokens
    )
    backend = _start_backend(args)
    try:
        events = run_wim(backend, backend.tokenizer, document, args.query, options)
        if args.json:
            result = await _collect(events)
            print(json.dumps(result, indent=2))
            return 1 if "error" in result else 0
        return await _show(events)
    finally:
        shutdown = getattr(backend, "shutdown", None)  # the reference backend has nothing to stop
        if shutdown is not None:
            shutdown()
