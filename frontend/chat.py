"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template.

The template writes bos itself, so the rendered prompt is encoded without special tokens.
Streaming sends, per choice, a first chunk with ``delta.role``, then ``content`` deltas; only a
choice's last chunk carries its ``finish_reason``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response
from jinja2 import TemplateError

from .completions import DONE_FRAME, sse_frame
from .disconnect import CLIENT_CLOSED_REQUEST, SSEResponse
from .errors import bad_request, error_body, error_for
from .logprobs import LogprobFormatter
from .openai_types import (ChatChoice, ChatChunkChoice, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                           ChatMessage, ChatMessageOut, Usage, to_json)
from .serving import (PromptInput, ServingContext, all_deltas, build_params, check_context_length, make_choices,
                      finish_without_streaming, request_id_of, stop_strings, usage_counts)
from .request_fields import CHAT_FIELDS, check_fields
from .structured_output import resolve_structured
from .tokenizer import TokenizerError

# OpenAI's roles; "developer" is the newer name of "system". Whether the model's template can
# render "tool"/"function" turns is the template's business (it raises if not).
KNOWN_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


async def render_messages(ctx: ServingContext, messages: list[ChatMessage],
                          add_generation_prompt: bool = True) -> list[int]:
    """The messages through the chat template, tokenized (off the event loop when large). Text
    that cannot fit the context is refused before rendering."""
    tokenizer = ctx.require_tokenizer("chat")
    if not tokenizer.chat_template:
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions", "messages")
    plain = []
    for i, message in enumerate(messages):
        if message.role not in KNOWN_ROLES:
            raise bad_request(f"messages[{i}].role: unknown role {message.role!r} (expected one of "
                              f"{', '.join(sorted(KNOWN_ROLES))})", "messages")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                                      "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": content if content is not None else ""}
        if message.name is not None:
            entry["name"] = message.name
        plain.append(entry)
    ctx.check_text_length(sum(len(m["content"]) + len(m.get("name") or "") for m in plain), "messages")
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except (TokenizerError, TemplateError) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
    return await tokenizer.encode_async(text, add_special_tokens=False)


class _ChatCompletion:
    @classmethod
    async def create(cls, ctx: ServingContext, raw: Request, req: ChatCompletionRequest) -> "_ChatCompletion":
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        ctx.admission.check_size(req.n)
        structured = await resolve_structured(req, ctx)
        return cls(ctx, raw, req, await render_messages(ctx, req.messages, req.add_generation_prompt), structured)

    def __init__(self, ctx: ServingContext, raw: Request, req: ChatCompletionRequest, prompt_ids: list[int],
                 structured=None):
        self.ctx, self.req = ctx, req
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as much as the context leaves
            if len(prompt_ids) >= ctx.max_model_len:
                check_context_length(ctx, len(prompt_ids), 1)
            max_tokens = ctx.max_model_len - len(prompt_ids)
        check_context_length(ctx, len(prompt_ids), max_tokens)
        self.top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = build_params(req, ctx, max_tokens=max_tokens, logprobs=self.top_n, structured=structured)
        stop = stop_strings(req, ctx)
        self.prompts = [PromptInput(prompt_ids, None)]
        self.choices = make_choices(ctx, raw, self.prompts, req.n, params, req, stop, accumulate=not req.stream)
        self.request_id = request_id_of(raw)
        self.id = f"chatcmpl-{self.request_id}"
        self.created = int(time.time())
        self.logprobs = LogprobFormatter(ctx.tokenizer)
        self.reservation = ctx.admit(req.n)  # last, so nothing above can fail with sequences reserved

    def usage(self) -> Usage:
        prompt_tokens, completion_tokens = usage_counts(self.prompts, self.choices)
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)

    def response(self) -> ChatCompletionResponse:
        out = []
        for choice in self.choices:
            stream = choice.output
            logprobs = self.logprobs.chat(stream.logprobs, self.top_n) if self.top_n is not None else None
            out.append(ChatChoice(choice.index, ChatMessageOut("assistant", stream.text), logprobs,
                                  stream.finish_reason, stream.stop_reason))
        return ChatCompletionResponse(self.id, "chat.completion", self.created, self.ctx.model_name, out,
                                      self.usage())

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_frame(ChatCompletionResponse(self.id, "chat.completion.chunk", self.created,
                                                self.ctx.model_name, choices, usage))

    async def events(self) -> AsyncGenerator[bytes, None]:
        opts = self.req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous_usage = include_usage and opts.continuous_usage_stats
        try:
            for choice in self.choices:  # the role first, as OpenAI does
                yield self._chunk([ChatChunkChoice(choice.index, ChatDelta(role="assistant", content=""))])
            deltas = all_deltas(self.ctx, self.choices)
            try:
                async for choice, delta in deltas:
                    has_logprobs = self.top_n is not None and bool(delta.logprobs)
                    if not delta.text and not has_logprobs and delta.finish_reason is None:
                        continue
                    logprobs = self.logprobs.chat(delta.logprobs or [], self.top_n) if has_logprobs else None
                    usage = None
                    if continuous_usage:
                        n_prompt, n_out = len(choice.prompt.token_ids), len(choice.output.token_ids)
                        usage = Usage(n_prompt, n_out, n_prompt + n_out)
                    content = ChatDelta(content=delta.text) if delta.text else ChatDelta()
                    yield self._chunk([ChatChunkChoice(choice.index, content, logprobs, delta.finish_reason,
                                                       delta.stop_reason)], usage)
            finally:
                await deltas.aclose()
            if include_usage:
                yield self._chunk([], self.usage())
        except Exception as exc:
            error = error_for(exc, self.request_id)
            yield sse_frame(error_body(error.message, error.type, error.param, error.code))
        finally:
            self.reservation.release()
        yield DONE_FRAME


async def create_chat_completion(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    req = ChatCompletionRequest.model_validate_json(body)
    check_fields(req, CHAT_FIELDS)
    chat = await _ChatCompletion.create(ctx, raw, req)
    if chat.req.stream:
        return SSEResponse(chat.events(), keepalive_s=ctx.sse_keepalive_s, admission=ctx.admission,
                           on_close=chat.reservation.release)
    try:
        if not await finish_without_streaming(ctx, raw, chat.choices):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        chat.reservation.release()
    return Response(to_json(chat.response()), media_type="application/json")
