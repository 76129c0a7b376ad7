"""Run every method on every task, one request stream at a time, and score the answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wim_service.eval.methods import METHODS, MethodResult, MethodSettings
from wim_service.eval.scoring import hallucinated_values, score
from wim_service.eval.tasks import Task, TaskKind

if TYPE_CHECKING:
    from wim_service.engine.vllm_engine import VLLMBackend


@dataclass(frozen=True)
class RunRecord:
    """One method on one task: its result (answer, cost, margins) and the answer's scores."""

    task_id: str
    kind: TaskKind
    length: int
    method: str
    gold: list[str]
    exact: float
    f1: float
    # The kind's own metric: F1 for aggregation, exact match for question answering.
    score: float
    result: MethodResult
    # Numbers and names in the answer that are not in the document (nor in the query).
    hallucinated: list[str]


async def evaluate(
    backend: VLLMBackend,
    tasks: list[Task],
    methods: list[str],
    settings: MethodSettings,
    progress: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Each task through each method, one at a time so wall times do not overlap.

    The method order rotates from task to task: load from other processes on a shared machine
    then drifts over all methods alike instead of always hitting the first one.
    """
    records = []
    for index, task in enumerate(tasks):
        turn = index % len(methods)
        for method in methods[turn:] + methods[:turn]:
            result = await METHODS[method](backend, task, settings)
            marks = score(task, result.answer)
            record = RunRecord(
                task_id=task.task_id,
                kind=task.kind,
                length=task.target_tokens,
                method=method,
                gold=list(task.gold),
                exact=marks.exact,
                f1=marks.f1,
                score=marks.primary(task.kind),
                result=result,
                hallucinated=hallucinated_values(result.answer, task),
            )
            records.append(record)
            if progress is not None:
                progress(record)
    return records
