"""Request and response bodies of the OpenAI-compatible API, shaped as the official `openai`
client's types (`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`, `Completion`,
`CompletionUsage`, `Model`) so that the SDK, LangChain, LlamaIndex and chat front ends read
them unchanged.

Requests accept and ignore the OpenAI parameters this service has no use for (every request
decodes greedily); `wim` and `document_id` are this service's additions (the SDK's
`extra_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from wim_service.wim.options import WiMOptions


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    # Unknown OpenAI parameters (temperature, top_p, seed, user, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    wim: WiMOptions | None = Field(
        None, description="WiM options (`extra_body`), the fields of `WiMOptions`."
    )
    document_id: str | None = Field(
        None, description="Ask about a document session from POST /documents (`extra_body`)."
    )

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]

    @property
    def answer_tokens(self) -> int | None:
        return self.max_tokens


# -- responses ------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # margins (and relevance judgements): WiM's reasoning


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


FinishReason = Literal["stop", "length"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    # The notes the answer read, as reasoning models report their reasoning (vLLM's field name).
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class Stamped(BaseModel):
    """What every object of one answer shares (each chunk of a stream too)."""

    id: str
    created: int
    model: str


class ChatCompletion(Stamped):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChunkChoice(BaseModel):
    index: int = 0
    # Only the keys this chunk carries: `role`, `content`, `reasoning_content`.
    delta: dict[str, str]
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Stamped):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    # With `stream_options.include_usage` every chunk has the key: null but in the last one.
    usage: CompletionUsage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(Stamped):
    """A text completion; streamed chunks have the same shape (`finish_reason` null first)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

    @classmethod
    def of(cls, message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
        return cls(
            error=ErrorDetail(message=message, type=type_, param=param, code=code)
        ).model_dump()
