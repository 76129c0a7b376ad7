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
import secrets
import time
from collections.abc import AsyncGenerator, Callable

from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.http.bodies import MAX_QUERY_CHARS, WiMRequest
from wim_service.serving.http.responses import event_stream
from wim_service.serving.openai.answers import Head, Outcome, Run, collect
from wim_service.serving.openai.models import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from wim_service.serving.openai.prompts import (
    chat_prompt_ids,
    chat_turns,
    document_and_query,
    served_model_name,
    split_document,
)
from wim_service.serving.replica.plain import PlainParams
from wim_service.serving.routing.quotas import JobLease
from wim_service.serving.routing.router import WiMRouter
from wim_service.serving.tenants import Capability, Tenant
from wim_service.wim.errors import ErrorCode
from wim_service.wim.options import WiMOptions
from wim_service.wim.tokenizer import Tokenizer


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
            raise ServiceError(
                ServiceCode.MODEL_NOT_FOUND,
                f"The model `{body.model}` does not exist.",
                param="model",
            )
        for param, why in body.unhonoured():
            raise ServiceError(ServiceCode.UNSUPPORTED, f"{param}: {why}", param=param)
        limit = self.router.config.router.max_document_chars + MAX_QUERY_CHARS
        if (size := sum(len(text) for text in texts)) > limit:
            raise ServiceError(
                ErrorCode.TOO_LONG,
                f"the prompt has {size} characters; this service takes at most {limit}",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant) -> Run:
        turns = chat_turns(body.messages)
        self._check(body, [turn.text for turn in turns])
        if body.document_id is not None:
            query = [turn.text for turn in turns if turn.role == "user"][-1]
            return await self._session_query(body, tenant, query, "messages")
        # Tokenizing is the costly part: only for a tenant that may run jobs and has one free.
        tenant.require(Capability.JOBS)
        async with self.router.gate.lease(tenant) as lease:
            prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, turns)
            if len(prompt_ids) >= self.router.config.router.plain_prompt_tokens:
                document, query = document_and_query(turns)
                if document:
                    return await self._wim(body, tenant, query, "messages", document, lease)
            return await self._plain(body, tenant, prompt_ids, "messages", lease)

    async def complete(self, body: CompletionRequest, tenant: Tenant) -> Run:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        self._check(body, [prompt])
        if body.document_id is not None:
            return await self._session_query(body, tenant, prompt, "prompt")
        tenant.require(Capability.JOBS)  # as in `chat`
        async with self.router.gate.lease(tenant) as lease:
            prompt_ids = await asyncio.to_thread(
                lambda: self.tokenizer.encode_user_text(prompt).ids
            )
            if len(prompt_ids) >= self.router.config.router.plain_prompt_tokens:
                document, query = split_document(prompt)
                if document:
                    return await self._wim(body, tenant, query, "prompt", document, lease)
            return await self._plain(body, tenant, prompt_ids, "prompt", lease)

    async def _session_query(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        text: str,
        param: str,
    ) -> Run:
        if split_document(text)[0]:
            raise ServiceError(
                ServiceCode.INVALID_REQUEST,
                "give the document either in the prompt or as document_id, not both",
                param=param,
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
            raise ServiceError(ServiceCode.INVALID_REQUEST, first["msg"], param=param) from exc

    async def _wim(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        query: str,
        param: str,
        context: str | None = None,
        lease: JobLease | None = None,
        *,
        document_id: str | None = None,
    ) -> Run:
        if not query:
            raise ServiceError(
                ServiceCode.INVALID_REQUEST,
                "the prompt asks nothing besides its document",
                param=param,
            )
        options = self._options(body)
        try:
            job = WiMRequest(
                context=context,
                document_id=document_id,
                query=query,
                options=options,
                stream=body.stream,
            )
        except ValidationError as exc:  # e.g. a query longer than /wim takes
            message = "; ".join(e["msg"] for e in exc.errors())
            raise ServiceError(ServiceCode.INVALID_REQUEST, message, param=param) from exc
        _, items = await self.router.start_job(job, tenant, lease)
        return Run(items, options.answer_max_tokens)

    async def _plain(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        prompt_ids: list[int],
        param: str,
        lease: JobLease,
    ) -> Run:
        window = self.router.config.engine.max_model_len
        # Without max_tokens the answer may take the window's room, up to `plain_max_tokens`:
        # the request reserves KV for all of it while it runs.
        room = window - len(prompt_ids)
        max_tokens = body.answer_tokens or min(room, self.router.config.router.plain_max_tokens)
        if max_tokens > room or max_tokens < 1:
            raise ServiceError(
                ErrorCode.TOO_LONG,
                f"This model's maximum context length is {window} tokens. However, you "
                f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                f"{param}, {max_tokens} in the completion). Please reduce the length of the "
                f"{param} or completion.",
                param=param,
            )
        salt = tenant.salt_for(body.user)
        params = PlainParams(max_tokens=max_tokens, stop=body.stops, cache_salt=salt)
        items = await self.router.start_plain(prompt_ids, params, tenant, lease, body.stream)
        return Run(items, max_tokens)

    # -- answers ----------------------------------------------------------------------------

    async def respond(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        run: Run,
        prefix: str,
        stream: Callable[[Run, Head], AsyncGenerator[str, None]],
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
            return event_stream(stream(run, head), self.router.config.router.stream_heartbeat_s)
        return JSONResponse(whole(head, await collect(run)).model_dump())
