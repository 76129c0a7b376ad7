"""The OpenAI-compatible API: `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions` (docs/openai.md).

How a request runs:

* With `document_id` (the SDK's `extra_body`), the last user turn is a query on that document
  session: WiM over its pinned KV.
* Otherwise the prompt (chat template included) is tokenized with the engines' tokenizer. Below
  `RouterConfig.plain_prompt_tokens` tokens it is one plain engine request. A longer prompt
  with a document runs WiM: the document is the text of the last user turn between
  `<document>` and `</document>`, or else the user turns before the last one (of each, its
  delimited part if it has one); the rest of the last user turn is the query. A long prompt
  without a document runs plain, if it fits the context window.
* WiM options come from `extra_body` `wim` (the fields of `WiMOptions`); `max_tokens` and
  `stop` apply to the answer. System and assistant turns take no part in WiM (its own prompts
  are `wim.prompts`). Every request decodes greedily.
* Streaming follows OpenAI's chunk format: the notes the answer reads (kept margins, in the
  document's words when snapped) as `reasoning_content` deltas,
  the answer as `content` deltas, `data: [DONE]` at the end. Usage counts every engine
  request of the job (`prompt_tokens_details.cached_tokens`: served from the KV cache;
  `completion_tokens_details.reasoning_tokens`: the margins').
* Errors are `{"error": {"message", "type", "param", "code"}}` with the status the SDK maps to
  its exception classes; an error after the stream has started is one `data: {"error": ...}`
  event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from wim_service.assets.default_model import GGUF_FILE
from wim_service.engine.config import EngineConfig
from wim_service.serving.http.auth import Tenant
from wim_service.serving.http.bodies import MAX_QUERY_CHARS, WiMRequest
from wim_service.serving.http.edge import caller
from wim_service.serving.http.errors import HTTPFailure, ServiceCode, framework_failure, status_of
from wim_service.serving.http.responses import Item
from wim_service.serving.openai.models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
)
from wim_service.serving.replica.plain import PlainParams
from wim_service.wim.errors import ErrorCode
from wim_service.wim.events import AnswerEvent, DoneEvent, ErrorEvent, MarginEvent, Usage
from wim_service.wim.options import WiMOptions
from wim_service.wim.tokenizer import Tokenizer

if TYPE_CHECKING:
    from wim_service.serving.routing.router import WiMRouter

OPEN_DOCUMENT, CLOSE_DOCUMENT = "<document>", "</document>"
# Private-use code points around a turn's number: where the chat template put that turn's text.
_TURN_MARK = "\ue010{}\ue011"
_TURN_MARK_RE = re.compile("\ue010(\\d+)\ue011")
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


# -- errors ---------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered in OpenAI's shape, its status from the one table (`errors.STATUS`)
    as OpenAI clients expect it: a prompt too long for the window is 400
    `context_length_exceeded`, a malformed request 400 (not 422)."""

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        status = status_of(code)
        if code == ErrorCode.TOO_LONG:
            status, code = 400, "context_length_exceeded"
        elif status == 422:
            status = 400
        self.status, self.message, self.code = status, message, str(code)
        self.param, self.retry_after = param, retry_after

    @classmethod
    def of(cls, failure: HTTPFailure) -> OpenAIError:
        return cls(failure.code, failure.message, retry_after=failure.retry_after)

    @property
    def type(self) -> str:
        named = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
        return named.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return ErrorResponse.of(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# pydantic names the member of a union that failed in an error's location ("str",
# "list[str]", "function-after[_utf8(), str]"): not a parameter's name.
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|none|list|dict)$|[\[(]")


def _field_path(location: tuple[Any, ...]) -> str:
    return ".".join(
        str(part) for part in location if not (isinstance(part, str) and _UNION_MEMBER.search(part))
    )


def _invalid(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    message = "; ".join(f"{_field_path(e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
    # The field at fault (a JSON syntax error's location is a character position: no field).
    where = errors[0]["loc"][1:] if errors else ()
    param = _field_path(where) if where and isinstance(where[0], str) else None
    return OpenAIError(ServiceCode.INVALID_REQUEST, message, param or None)


class OpenAIRoute(APIRoute):
    """Answers every error of its routes (authentication included) in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return exc.response()
            except HTTPFailure as exc:
                return OpenAIError.of(exc).response()
            except RequestValidationError as exc:
                return _invalid(exc).response()
            except StarletteHTTPException as exc:  # e.g. a body that is not UTF-8
                return OpenAIError.of(framework_failure(exc)).response()

        return route


# -- prompts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    role: str  # system, user or assistant
    text: str


def chat_turns(messages: list[ChatMessage]) -> list[Turn]:
    turns = []
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if message.role in ("tool", "function"):
            raise OpenAIError(ServiceCode.UNSUPPORTED, "tool messages are not supported", where)
        content = message.content
        if content is None:
            if message.role != "assistant":
                raise OpenAIError(
                    ServiceCode.INVALID_REQUEST, f"a {message.role} message needs content", where
                )
            content = ""
        if not isinstance(content, str):
            if any(part.type != "text" or part.text is None for part in content):
                raise OpenAIError(ServiceCode.UNSUPPORTED, "only text content is supported", where)
            content = "".join(part.text or "" for part in content)
        turns.append(Turn("system" if message.role == "developer" else message.role, content))
    if not any(turn.role == "user" for turn in turns):
        raise OpenAIError(ServiceCode.INVALID_REQUEST, "the messages have no user turn", "messages")
    return turns


def chat_prompt_ids(tokenizer: Tokenizer, turns: list[Turn]) -> list[int]:
    """The model's chat template over `turns`, rendered with a marker in place of each turn's
    text. Only the template's own text is tokenized with special tokens recognised; the turns'
    text is tokenized as text (`<|im_end|>` typed by a client stays text), as in `wim.prompts`.
    """
    rendered = tokenizer.render_chat(
        [{"role": turn.role, "content": _TURN_MARK.format(i)} for i, turn in enumerate(turns)]
    )
    pieces = _TURN_MARK_RE.split(rendered)
    if sorted(int(p) for p in pieces[1::2]) != list(range(len(turns))):
        raise OpenAIError(
            ServiceCode.INVALID_REQUEST,
            "the model's chat template cannot render these messages",
            "messages",
        )
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids += tokenizer.encode_user_text(turns[int(piece)].text).ids
        elif piece:
            ids += tokenizer.encode_template_text(piece)
    return ids


def split_document(text: str) -> tuple[str, str]:
    """(the text between `<document>` delimiters, the rest of `text`).

    One left-to-right scan, linear in the text: it runs on the router's event loop, where a
    backtracking regex was quadratic on repeated openings (80 KB of `<document>` took 5.4 s).
    Each opening pairs with the first closing after it; an opening without one is text.
    """
    blocks: list[str] = []
    rest: list[str] = []
    at = 0
    while (start := text.find(OPEN_DOCUMENT, at)) >= 0:
        end = text.find(CLOSE_DOCUMENT, start + len(OPEN_DOCUMENT))
        if end < 0:
            break
        blocks.append(text[start + len(OPEN_DOCUMENT) : end].strip())
        rest.append(text[at:start])
        at = end + len(CLOSE_DOCUMENT)
    rest.append(text[at:])
    return "\n\n".join(blocks), " ".join(rest).strip()


def document_and_query(turns: list[Turn]) -> tuple[str, str]:
    """The document and the query of a chat (see the module's docstring)."""
    users = [turn.text for turn in turns if turn.role == "user"]
    document, query = split_document(users[-1])
    if not document:
        document = "\n\n".join(split_document(text)[0] or text for text in users[:-1])
    return document, query


def served_model_name(engine: EngineConfig) -> str:
    return Path(engine.model).name if engine.model else GGUF_FILE.partition(".")[0]


# -- usage and output -----------------------------------------------------------------------


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
    async for _, event in run.items:
        if isinstance(event, MarginEvent) and (line := margin_line(event)):
            margins[event.segment] = line
        elif isinstance(event, ErrorEvent):
            raise HTTPFailure(event.code, event.message, event.retry_after_s)
        elif isinstance(event, DoneEvent):
            return Outcome(
                event.answer,
                "".join(margins[k] for k in sorted(margins)),
                openai_usage(event.usage),
                run.finish_reason(event),
            )
    raise HTTPFailure(ErrorCode.ENGINE_ERROR, "the job ended without an answer")


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _late_error(event: ErrorEvent) -> str:
    return _data(OpenAIError.of(HTTPFailure(event.code, event.message)).body())


@dataclass(frozen=True)
class Head:
    """What every object of one answer shares, and whether its stream reports usage."""

    stamp: dict[str, Any]  # `Stamped`'s fields: id, created, model
    include_usage: bool

    def dump(self, chunk: ChatCompletionChunk | Completion) -> str:
        return _data(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))


async def chat_stream(run: Run, head: Head) -> AsyncIterator[str]:
    def chunk(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        return head.dump(ChatCompletionChunk(**head.stamp, choices=choices, usage=usage))

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
    yield "data: [DONE]\n\n"


async def completion_stream(run: Run, head: Head) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> str:
        return head.dump(Completion(**head.stamp, choices=choices, usage=usage))

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
    yield "data: [DONE]\n\n"


def chat_answer(head: Head, outcome: Outcome) -> ChatCompletion:
    message = AssistantMessage(content=outcome.answer, reasoning_content=outcome.reasoning or None)
    choice = ChatChoice(message=message, finish_reason=outcome.finish_reason)
    return ChatCompletion(**head.stamp, choices=[choice], usage=outcome.usage)


def completion_answer(head: Head, outcome: Outcome) -> Completion:
    choice = CompletionChoice(text=outcome.answer, finish_reason=outcome.finish_reason)
    return Completion(**head.stamp, choices=[choice], usage=outcome.usage)


# -- the service ----------------------------------------------------------------------------


class OpenAIService:
    """Turns OpenAI requests into WiM jobs or plain requests on a `WiMRouter`."""

    def __init__(self, router: WiMRouter) -> None:
        self.router = router
        self.model = served_model_name(router.config.engine)
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Tokenizer:
        return self.router.dispatcher.sizer.tokenizer

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model, created=self.created, owned_by="wim")])

    def _check(self, body: ChatCompletionRequest | CompletionRequest, texts: list[str]) -> None:
        """Refuse what cannot be honoured, and a prompt past the service's input limit before
        any tokenization (the limit of `/wim`: a document and a query)."""
        if body.model != self.model:
            raise OpenAIError(
                ServiceCode.MODEL_NOT_FOUND, f"The model `{body.model}` does not exist.", "model"
            )
        for param, why in body.unhonoured():
            raise OpenAIError(ServiceCode.UNSUPPORTED, f"{param}: {why}", param)
        limit = self.router.config.router.max_document_chars + MAX_QUERY_CHARS
        if (size := sum(len(text) for text in texts)) > limit:
            raise OpenAIError(
                ErrorCode.TOO_LONG,
                f"the prompt has {size} characters; this service takes at most {limit}",
                "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant) -> Run:
        turns = chat_turns(body.messages)
        self._check(body, [turn.text for turn in turns])
        if body.document_id is not None:
            query = [turn.text for turn in turns if turn.role == "user"][-1]
            return await self._session_query(body, tenant, query, "messages")
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, turns)
        if len(prompt_ids) >= self.router.config.router.plain_prompt_tokens:
            document, query = document_and_query(turns)
            if document:
                return await self._wim(body, tenant, query, "messages", context=document)
        return await self._plain(body, tenant, prompt_ids, "messages")

    async def complete(self, body: CompletionRequest, tenant: Tenant) -> Run:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        self._check(body, [prompt])
        if body.document_id is not None:
            return await self._session_query(body, tenant, prompt, "prompt")
        prompt_ids = await asyncio.to_thread(lambda: self.tokenizer.encode_user_text(prompt).ids)
        if len(prompt_ids) >= self.router.config.router.plain_prompt_tokens:
            document, query = split_document(prompt)
            if document:
                return await self._wim(body, tenant, query, "prompt", context=document)
        return await self._plain(body, tenant, prompt_ids, "prompt")

    async def _session_query(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        text: str,
        param: str,
    ) -> Run:
        if split_document(text)[0]:
            raise OpenAIError(
                ServiceCode.INVALID_REQUEST,
                "give the document either in the prompt or as document_id, not both",
                param,
            )
        return await self._wim(body, tenant, text.strip(), param, document_id=body.document_id)

    def _options(self, body: ChatCompletionRequest | CompletionRequest) -> WiMOptions:
        given = body.wim.model_dump(exclude_unset=True) if body.wim else {}
        if body.answer_tokens:
            given["answer_max_tokens"] = body.answer_tokens
        if body.stops:
            given["answer_stop"] = [*given.get("answer_stop", []), *body.stops]
        try:
            return WiMOptions.model_validate(given)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = "max_tokens" if first["loc"][0] == "answer_max_tokens" else "wim"
            raise OpenAIError(ServiceCode.INVALID_REQUEST, first["msg"], param) from exc

    async def _wim(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        query: str,
        param: str,
        *,
        context: str | None = None,
        document_id: str | None = None,
    ) -> Run:
        if not query:
            raise OpenAIError(
                ServiceCode.INVALID_REQUEST, "the prompt asks nothing besides its document", param
            )
        options = self._options(body)
        try:
            job = WiMRequest(context=context, document_id=document_id, query=query, options=options)
        except ValidationError as exc:  # e.g. a query longer than /wim takes
            message = "; ".join(e["msg"] for e in exc.errors())
            raise OpenAIError(ServiceCode.INVALID_REQUEST, message, param) from exc
        _, items = await self.router.start_job(job, tenant)
        return Run(items, options.answer_max_tokens)

    async def _plain(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        prompt_ids: list[int],
        param: str,
    ) -> Run:
        window = self.router.config.engine.max_model_len
        # Without max_tokens the answer may take the window's room, up to `plain_max_tokens`:
        # the request reserves KV for all of it while it runs.
        room = window - len(prompt_ids)
        max_tokens = body.answer_tokens or min(room, self.router.config.router.plain_max_tokens)
        if max_tokens > room or max_tokens < 1:
            raise OpenAIError(
                ErrorCode.TOO_LONG,
                f"This model's maximum context length is {window} tokens. However, you "
                f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                f"{param}, {max_tokens} in the completion). Please reduce the length of the "
                f"{param} or completion.",
                param,
            )
        params = PlainParams(max_tokens=max_tokens, stop=body.stops, cache_salt=tenant.cache_salt)
        return Run(await self.router.start_plain(prompt_ids, params, tenant), max_tokens)

    # -- answers ----------------------------------------------------------------------------

    async def respond(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        run: Run,
        prefix: str,
        stream: Callable[[Run, Head], AsyncIterator[str]],
        whole: Callable[[Head, Outcome], ChatCompletion | Completion],
    ) -> Response:
        """The answer as server-sent chunks (`stream`) or one object (`whole`)."""
        stamp = {
            "id": prefix + secrets.token_hex(12),
            "created": int(time.time()),
            "model": self.model,
        }
        head = Head(stamp, body.include_usage)
        if body.stream:
            return StreamingResponse(
                stream(run, head), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return JSONResponse(whole(head, await collect(run)).model_dump())


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
