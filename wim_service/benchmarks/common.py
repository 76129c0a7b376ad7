"""What both benchmarks share: their settings, the sample document and queries, one timed WiM
job on an in-process backend, and the printed result line."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wim_service.engine.config import EngineConfig
from wim_service.wim.backend import Backend
from wim_service.wim.events import DoneEvent, MarginEvent
from wim_service.wim.options import WiMOptions
from wim_service.wim.orchestrator import run_wim

DEFAULT_DOCUMENT = Path(__file__).resolve().parents[2] / "examples" / "harbor_report.txt"
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


@dataclass(frozen=True)
class BenchSettings:
    context: Path  # the document, joined `repeat` times
    repeat: int
    options: WiMOptions  # every WiM job's
    options_file: Path | None  # where they came from, if not only from flags
    concurrency: int  # documents at once for the engine benchmark's (c)
    rounds: int  # repetitions of every side-by-side measurement
    skip_reference: bool
    json_out: Path | None
    engine: EngineConfig

    def document(self) -> str:
        return "\n\n".join([self.context.read_text(encoding="utf-8")] * self.repeat)

    def wire_options(self) -> dict[str, Any]:
        """The options as an HTTP body carries them: what differs from the defaults."""
        return self.options.model_dump(mode="json", exclude_defaults=True)

    def header(self, command: str) -> None:
        options = f", options from {self.options_file}" if self.options_file else ""
        print(
            f"{command}: {self.context.name} x{self.repeat}, segments of "
            f"~{self.options.segment_tokens} tokens, relevance {self.options.relevance}"
            f"{options}, dtype {self.engine.dtype_label()}",
            flush=True,
        )

    def save(self, results: dict[str, Any]) -> None:
        if self.json_out:
            self.json_out.write_text(json.dumps(results, indent=2))


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


def line(label: str, value: str) -> None:
    print(f"  {label:<58} {value}", flush=True)
