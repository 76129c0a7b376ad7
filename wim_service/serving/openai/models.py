"""Request and response bodies of the OpenAI-compatible API, shaped as the official `openai`
client's types (`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`, `Completion`,
`CompletionUsage`, `Model`) so that the SDK, LangChain, LlamaIndex and chat front ends read
them unchanged.

Requests take OpenAI's documented ranges and limits (temperature 0-2, top_p 0-1, at most 4
stop sequences, top_logprobs at most 20). Every parameter is honoured or refused by name
(`OpenAIService` refuses values this service cannot honour, `unsupported()` any other
parameter given a value): nothing a client asks for is dropped silently. `wim` and
`document_id` are this service's additions (the SDK's `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from wim_service.wim.options import StopString, Utf8Text, WiMOptions

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 64
# Values of an unknown parameter that ask for nothing (a client replaying OpenAI's defaults
# or an SDK object's null fields): accepted, since they change nothing.
_NOTHING_ASKED: tuple[Any, ...] = (None, False, [], {}, "none", "auto", {"type": "text"})


class _Strict(BaseModel):
    # Unknown keys are kept so that `unsupported()` can name them: refused unless they ask
    # for nothing, where extra="ignore" would drop them silently.
    model_config = ConfigDict(extra="allow")

    def unsupported(self) -> list[str]:
        """The unknown parameters given a value, as dotted paths (nested models included)."""
        named = [
            key for key, value in (self.model_extra or {}).items() if value not in _NOTHING_ASKED
        ]
        for key in type(self).model_fields:
            value = getattr(self, key)
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if isinstance(child, _Strict):
                    where = f"{key}.{index}" if isinstance(value, list) else key
                    named += [f"{where}.{inner}" for inner in child.unsupported()]
        return named


class ContentPart(_Strict):
    type: str
    text: Utf8Text | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Utf8Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = (
        None
    )


class StreamOptions(_Strict):
    include_usage: bool = False


Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)]


class _Request(_Strict):
    model: str = Field(..., max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    stop: Stop | None = None
    # Every request decodes greedily: temperature 0 is honoured, any other value is refused;
    # under greedy decoding top_p and seed change nothing, so every valid value is honoured.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # An end user's id: its plain requests share a prefix cache with no other end user's.
    user: str | None = Field(None, max_length=256)
    wim: WiMOptions | None = Field(
        None, description="WiM options (`extra_body`), the fields of `WiMOptions`."
    )
    document_id: str | None = Field(
        None,
        max_length=128,
        description="Ask about a document session from POST /documents (`extra_body`).",
    )

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    # Parameters refused when given anything but 0, false or null, and why.
    REFUSED_UNLESS_OFF: ClassVar[dict[str, str]] = {
        "temperature": "this service decodes greedily: give 0 or omit it",
        "frequency_penalty": "penalties are not supported: give 0 or omit it",
        "presence_penalty": "penalties are not supported: give 0 or omit it",
    }

    def unhonoured(self) -> list[tuple[str, str]]:
        """(parameter, why) for each parameter given a value this service cannot honour."""
        refused = [(name, "this parameter is not supported") for name in self.unsupported()]
        if self.n != 1:
            refused.append(("n", "only n=1 is supported"))
        refused += [
            (name, why) for name, why in self.REFUSED_UNLESS_OFF.items() if getattr(self, name)
        ]
        return refused


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    REFUSED_UNLESS_OFF: ClassVar[dict[str, str]] = {
        **_Request.REFUSED_UNLESS_OFF,
        "logprobs": "log probabilities are not supported",
        "top_logprobs": "log probabilities are not supported",
    }


class CompletionRequest(_Request):
    prompt: Utf8Text | Annotated[list[Utf8Text], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @property
    def answer_tokens(self) -> int | None:
        return self.max_tokens

    REFUSED_UNLESS_OFF: ClassVar[dict[str, str]] = {
        **_Request.REFUSED_UNLESS_OFF,
        "logprobs": "log probabilities are not supported",
        "echo": "echoing the prompt is not supported",
    }


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
