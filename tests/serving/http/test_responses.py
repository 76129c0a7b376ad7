"""A whole (not streamed) answer reads its job to the end before it is sent (`after_done`,
which the `/wim` answer and the OpenAI API's both use)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from wim_service.serving.http.responses import Item, json_response
from wim_service.serving.openai.answers import Run, collect
from wim_service.wim.events import AnswerEvent, DoneEvent, Timings, Usage


class _Job:
    """A job's events as a replica's call yields them: its clean-up runs after `done`."""

    def __init__(self) -> None:
        self.cleaned_up = False

    async def items(self) -> AsyncIterator[Item]:
        yield "replica-a", AnswerEvent(text="4417")
        yield "replica-a", DoneEvent(answer="4417", usage=Usage(answer_tokens=1), timings=Timings())
        self.cleaned_up = True  # not reached if the caller closes the events at `done`


async def test_a_json_answer_lets_its_job_end_as_it_ran() -> None:
    """Closed at `done`, the replica's call was cancelled in its clean-up (Serve logged the
    answered call CANCELLED) and the job's books stayed open past the answer."""
    job = _Job()
    response = await json_response(job.items(), "s-1")
    assert json.loads(response.body)["answer"] == "4417"
    assert job.cleaned_up


async def test_an_openai_answer_lets_its_job_end_as_it_ran() -> None:
    job = _Job()
    outcome = await collect(Run(job.items(), max_tokens=16))
    assert outcome.answer == "4417" and outcome.finish_reason == "stop"
    assert job.cleaned_up
