"""The `/v1` routes of the OpenAI-compatible API (docs/openai.md) over a `WiMRouter`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from wim_service.serving.http.edge import caller
from wim_service.serving.openai.answers import (
    chat_answer,
    chat_stream,
    completion_answer,
    completion_stream,
)
from wim_service.serving.openai.errors import OpenAIRoute
from wim_service.serving.openai.models import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from wim_service.serving.openai.service import OpenAIService
from wim_service.serving.routing.router import WiMRouter

STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


def openai_routes(router: WiMRouter) -> APIRouter:
    """The `/v1` routes over `router`. Include them behind the app's authentication."""
    service = OpenAIService(router)
    api = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["OpenAI-compatible"])

    @api.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The one model this service runs."""
        return service.models()

    @api.post("/chat/completions", response_model=ChatCompletion, responses=STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """A chat completion; a long document in the messages is read with WiM."""
        run = await service.chat(body, caller(request))
        return await service.respond(body, run, "chatcmpl-", chat_stream, chat_answer)

    @api.post("/completions", response_model=Completion, responses=STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """A text completion; a long `<document>` in the prompt is read with WiM."""
        run = await service.complete(body, caller(request))
        return await service.respond(body, run, "cmpl-", completion_stream, completion_answer)

    return api
