"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template
(chat_prompt.py, with vLLM's options: ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, ``tools`` with ``tool_choice: "none"``).

The template writes bos itself, so the rendered prompt is encoded without special tokens.
Streaming sends, per choice, a first chunk with ``delta.role``, then (with vLLM's ``echo``) the
echoed last message, then ``content`` deltas; only a choice's last chunk carries its
``finish_reason``. ``prompt_logprobs`` (vLLM) come with a whole response, at its top level.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from .chat_prompt import ChatOptions, echoed_text, plain_messages, render_prompt, reply_role
from .completions import DONE_FRAME, sse_frame
from .disconnect import CLIENT_CLOSED_REQUEST, SSEResponse
from .errors import bad_request, error_body, error_for
from .logprobs import LogprobFormatter
from .openai_types import (ChatChoice, ChatChunkChoice, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                           ChatMessage, ChatMessageOut, Usage, to_json)
from .serving import (PromptInput, ServingContext, all_deltas, build_params, check_context_length,
                      default_max_tokens, make_choices, finish_without_streaming, request_id_of, stop_strings,
                      usage_counts)
from .request_fields import CHAT_FIELDS, check_fields
from .structured_output import resolve_structured


def chat_options(req: ChatCompletionRequest) -> ChatOptions:
    """The request's chat-template options; tools only with ``tool_choice: "none"`` (vLLM without
    automatic tool choice: OpenAI's default for a request with tools is "auto")."""
    if req.tool_choice is not None and req.tool_choice != "none":
        shown = repr(req.tool_choice) if isinstance(req.tool_choice, str) else "naming a function"
        raise bad_request(f"tool_choice {shown} is not supported yet (no tool calls are served): leave tools out "
                          'or set tool_choice to "none"', "tool_choice")
    if req.tools and req.tool_choice is None:
        raise bad_request('tools without tool_choice mean tool_choice "auto", which is not supported yet (no tool '
                          'calls are served): set tool_choice to "none"', "tool_choice")
    tools = [tool.model_dump() for tool in req.tools] if req.tools else None
    return ChatOptions(req.add_generation_prompt, req.continue_final_message, tools, req.chat_template_kwargs)


async def render_messages(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          options: ChatOptions | None = None) -> list[int]:
    """The messages through the chat template (chat_prompt.py), tokenized (off the event loop when
    large). Text that cannot fit the context is refused before rendering."""
    return await _render(ctx, plain_messages(messages), options or ChatOptions(add_generation_prompt))


async def _render(ctx: ServingContext, plain: list[dict], options: ChatOptions) -> list[int]:
    tokenizer = ctx.require_tokenizer("chat")
    ctx.check_text_length(sum(len(m["content"]) + len(m.get("name") or "") for m in plain), "messages")
    text = render_prompt(tokenizer, plain, options)
    return await tokenizer.encode_async(text, add_special_tokens=False)


class _ChatCompletion:
    @classmethod
    async def create(cls, ctx: ServingContext, raw: Request, req: ChatCompletionRequest) -> "_ChatCompletion":
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        ctx.admission.check_size(req.n)
        options = chat_options(req)
        options.check()
        messages = plain_messages(req.messages)
        structured = await resolve_structured(req, ctx)
        prompt_ids = await _render(ctx, messages, options)
        return cls(ctx, raw, req, prompt_ids, messages, options, structured)

    def __init__(self, ctx: ServingContext, raw: Request, req: ChatCompletionRequest, prompt_ids: list[int],
                 messages: list[dict], options: ChatOptions, structured=None):
        self.ctx, self.req = ctx, req
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as much as the context leaves
            if len(prompt_ids) >= ctx.max_model_len:
                check_context_length(ctx, len(prompt_ids), 1)
            max_tokens = ctx.max_model_len - len(prompt_ids)
        check_context_length(ctx, len(prompt_ids), max_tokens)
        max_tokens = default_max_tokens(ctx, max_tokens)
        self.top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = build_params(req, ctx, max_tokens=max_tokens, logprobs=self.top_n, structured=structured)
        self.role = reply_role(messages, options)
        self.echo = echoed_text(messages, self.role) if req.echo else ""
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
            out.append(ChatChoice(choice.index, ChatMessageOut(self.role, self.echo + stream.text), logprobs,
                                  stream.finish_reason, stream.stop_reason))
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None and self.choices:
            entries = self.choices[0].output.prompt_logprobs or []
            prompt_logprobs = self.logprobs.prompt_logprobs(entries, self.req.prompt_logprobs)
        return ChatCompletionResponse(self.id, "chat.completion", self.created, self.ctx.model_name, out,
                                      self.usage(), prompt_logprobs)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_frame(ChatCompletionResponse(self.id, "chat.completion.chunk", self.created,
                                                self.ctx.model_name, choices, usage))

    async def events(self) -> AsyncGenerator[bytes, None]:
        opts = self.req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous_usage = include_usage and opts.continuous_usage_stats
        try:
            for choice in self.choices:  # the role first, as OpenAI does
                yield self._chunk([ChatChunkChoice(choice.index, ChatDelta(role=self.role, content=""))])
            if self.echo:  # then the echoed last message (vLLM)
                for choice in self.choices:
                    yield self._chunk([ChatChunkChoice(choice.index, ChatDelta(content=self.echo))])
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
