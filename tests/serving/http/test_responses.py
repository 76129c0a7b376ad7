"""A whole (not streamed) answer reads its job to the end before it is sent, and an error
ends the job at once (`after_done` and `close`, which the `/wim` answer and the OpenAI API's
both use)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from wim_service.serving.errors import ServiceError
from wim_service.serving.http.responses import Item, json_response
from wim_service.serving.openai.answers import Run, collect
from wim_service.wim.events import AnswerEvent, DoneEvent, ErrorEvent, Timings, Usage, WiMEvent

DONE = DoneEvent(answer="4417", usage=Usage(answer_tokens=1), timings=Timings())
FAILED = ErrorEvent(code="engine_error", message="the engine failed")


class _Job:
    """A job's events as a replica's call yields them: its clean-up runs after its last event,
    and its `finally` whenever it ends."""

    def __init__(self, last: WiMEvent) -> None:
        self.last = last
        self.cleaned_up = self.ended = False

    async def items(self) -> AsyncIterator[Item]:
        try:
            yield "replica-a", AnswerEvent(text="4417")
            yield "replica-a", self.last
            self.cleaned_up = True  # not reached if the caller closes the events at `done`
        finally:
            self.ended = True


async def _json_answer(job: _Job) -> str:
    response = await json_response(job.items(), "s-1")
    return json.loads(response.body)["answer"]


async def _openai_answer(job: _Job) -> str:
    return (await collect(Run(job.items(), max_tokens=16))).answer


WHOLE_ANSWERS = [_json_answer, _openai_answer]


@pytest.mark.parametrize("answer", WHOLE_ANSWERS, ids=["wim", "openai"])
async def test_a_whole_answer_lets_its_job_end_as_it_ran(answer) -> None:
    """Closed at `done`, the replica's call was cancelled in its clean-up (Serve logged the
    answered call CANCELLED) and the job's books stayed open past the answer."""
    job = _Job(DONE)
    assert await answer(job) == "4417"
    assert job.cleaned_up and job.ended


@pytest.mark.parametrize("answer", WHOLE_ANSWERS, ids=["wim", "openai"])
async def test_a_whole_answer_that_fails_ends_its_job_at_once(answer) -> None:
    """Not whenever the abandoned events are collected."""
    job = _Job(FAILED)
    with pytest.raises(ServiceError) as raised:
        await answer(job)
    assert raised.value.message == "the engine failed"
    assert job.ended and not job.cleaned_up
