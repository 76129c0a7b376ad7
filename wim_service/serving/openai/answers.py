"""A started OpenAI request's events as OpenAI answers: one object, or streamed chunks in
OpenAI's format (the notes as `reasoning_content`, the answer as `content`, `data: [DONE]`)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from wim_service.serving.errors import ServiceError
from wim_service.serving.http.responses import Item, after_done, close
from wim_service.serving.openai.errors import OpenAIError
from wim_service.serving.openai.models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionTokensDetails,
    CompletionUsage,
    FinishReason,
    PromptTokensDetails,
)
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import AnswerEvent, DoneEvent, ErrorEvent, MarginEvent, Usage


def openai_usage(usage: Usage) -> CompletionUsage:
    # Every token the engine generated for the job, an answer started early and discarded too.
    completion = usage.margin_tokens + usage.answer_tokens + usage.discarded_answer_tokens
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens_submitted,
        completion_tokens=completion,
        total_tokens=usage.prompt_tokens_submitted + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.prompt_tokens_cached),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.margin_tokens),
    )


def margin_line(event: MarginEvent) -> str | None:
    """A margin as reasoning: only a note the final step reads, as it reads it (a snapped note
    is the document's own sentences). A margin the grounding check dropped is left out: shown
    as the model's reasoning, an invented fact would mislead as much as in the answer."""
    if not event.kept:
        return None
    return f"[segment {event.segment + 1}] {event.evidence or event.text}\n"


@dataclass
class Run:
    """A started request: its events (the first already produced) and its answer budget."""

    items: AsyncIterator[Item]
    max_tokens: int

    def finish_reason(self, done: DoneEvent) -> FinishReason:
        return "length" if done.usage.answer_tokens >= self.max_tokens else "stop"


@dataclass
class Outcome:
    answer: str
    reasoning: str
    usage: CompletionUsage
    finish_reason: FinishReason


async def collect(run: Run) -> Outcome:
    margins: dict[int, str] = {}
    try:
        async for _, event in run.items:
            if isinstance(event, MarginEvent) and (line := margin_line(event)):
                margins[event.segment] = line
            elif isinstance(event, ErrorEvent):
                raise ServiceError(event.code, event.message, event.retry_after_s)
            elif isinstance(event, DoneEvent):
                await after_done(run.items)
                return Outcome(
                    event.answer,
                    "".join(margins[k] for k in sorted(margins)),
                    openai_usage(event.usage),
                    run.finish_reason(event),
                )
    finally:
        await close(run.items)  # as in `json_response`
    raise ServiceError(ErrorCode.ENGINE_ERROR, "the job ended without an answer")


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _late_error(event: ErrorEvent) -> str:
    return _data(OpenAIError.of(ServiceError(event.code, event.message)).body())


@dataclass(frozen=True)
class Head:
    """What every object of one answer shares, and whether its stream reports usage."""

    stamp: dict[str, Any]  # `Stamped`'s fields: id, created, model
    include_usage: bool

    def dump(self, chunk: ChatCompletionChunk | Completion) -> str:
        return _data(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))


async def chat_stream(run: Run, head: Head) -> AsyncGenerator[str, None]:
    def chunk(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        return head.dump(ChatCompletionChunk(**head.stamp, choices=choices, usage=usage))

    try:
        yield chunk([ChunkChoice(delta={"role": "assistant", "content": ""})])
        async for _, event in run.items:
            if isinstance(event, MarginEvent) and (line := margin_line(event)):
                yield chunk([ChunkChoice(delta={"reasoning_content": line})])
            elif isinstance(event, AnswerEvent):
                yield chunk([ChunkChoice(delta={"content": event.text})])
            elif isinstance(event, ErrorEvent):
                yield _late_error(event)
                break
            elif isinstance(event, DoneEvent):
                yield chunk([ChunkChoice(delta={}, finish_reason=run.finish_reason(event))])
                if head.include_usage:
                    yield chunk([], openai_usage(event.usage))
    finally:
        await close(run.items)  # a response closed between two events ends the job now
    yield "data: [DONE]\n\n"


async def completion_stream(run: Run, head: Head) -> AsyncGenerator[str, None]:
    def chunk(choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> str:
        return head.dump(Completion(**head.stamp, choices=choices, usage=usage))

    try:
        async for _, event in run.items:
            if isinstance(event, AnswerEvent):
                yield chunk([CompletionChoice(text=event.text)])
            elif isinstance(event, ErrorEvent):
                yield _late_error(event)
                break
            elif isinstance(event, DoneEvent):
                yield chunk([CompletionChoice(text="", finish_reason=run.finish_reason(event))])
                if head.include_usage:
                    yield chunk([], openai_usage(event.usage))
    finally:
        await close(run.items)  # as in `chat_stream`
    yield "data: [DONE]\n\n"


def chat_answer(head: Head, outcome: Outcome) -> ChatCompletion:
    message = AssistantMessage(content=outcome.answer, reasoning_content=outcome.reasoning or None)
    choice = ChatChoice(message=message, finish_reason=outcome.finish_reason)
    return ChatCompletion(**head.stamp, choices=[choice], usage=outcome.usage)


def completion_answer(head: Head, outcome: Outcome) -> Completion:
    choice = CompletionChoice(text=outcome.answer, finish_reason=outcome.finish_reason)
    return Completion(**head.stamp, choices=[choice], usage=outcome.usage)
