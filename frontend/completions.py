"""``POST /v1/completions``: prompts (text or token ids, one or many) x ``n`` choices.

Choice ``index`` = prompt_index * n + i. ``echo`` prepends the prompt (with ``logprobs``, the
prompt tokens' logprobs too, which the engine computes when asked for ``prompt_logprobs``), so
lm-evaluation-harness' loglikelihood requests (``echo``, ``logprobs: 1``, ``max_tokens`` 0 or 1, token
ids) work. vLLM's ``prompt_logprobs`` field asks for them on its own, in vLLM's format, in each
choice of a whole (non-streamed) response. ``max_tokens: 0`` without prompt logprobs never reaches
the engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from .disconnect import CLIENT_CLOSED_REQUEST, SSEResponse
from .errors import bad_request, error_body, error_for
from .logprobs import LogprobFormatter
from .openai_types import (CompletionChoice, CompletionChoiceWithIds, CompletionChoiceWithPromptLogprobs,
                           CompletionRequest, CompletionResponse, Usage, to_json)
from .output_stream import StreamDelta
from .request_fields import COMPLETION_FIELDS, check_fields
from .structured_output import resolve_structured
from .serving import (Choice, PromptInput, ServingContext, all_deltas, build_params, check_context_length,
                      default_max_tokens, make_choices, parse_prompts, finish_without_streaming, request_id_of,
                      stop_strings, usage_counts)

DEFAULT_MAX_TOKENS = 16
DONE_FRAME = b"data: [DONE]\n\n"


def sse_frame(payload) -> bytes:
    return b"data: " + to_json(payload) + b"\n\n"


class _Completion:
    """One /v1/completions request, validated, with what formatting its output needs."""

    @classmethod
    async def create(cls, ctx: ServingContext, raw: Request, req: CompletionRequest) -> "_Completion":
        ctx.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of ({req.best_of}) is not supported: leave it out or set it equal to n "
                              f"({req.n})", "best_of")
        structured = await resolve_structured(req, ctx)
        prompts = await parse_prompts(req.prompt, ctx, req.n)
        if req.echo and ctx.tokenizer is not None:  # decode token-id prompts now, off the event loop if long
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = await ctx.tokenizer.decode_async(prompt.token_ids)
        return cls(ctx, raw, req, prompts, structured)

    def __init__(self, ctx: ServingContext, raw: Request, req: CompletionRequest, prompts: list[PromptInput],
                 structured=None):
        self.ctx, self.req = ctx, req
        self.prompts = prompts
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        for prompt in self.prompts:
            check_context_length(ctx, len(prompt.token_ids), max_tokens)
        max_tokens = default_max_tokens(ctx, max_tokens)
        self.echo = bool(req.echo)
        echo_logprobs = req.logprobs if self.echo and req.logprobs is not None else None
        params = build_params(req, ctx, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_logprobs,
                              structured=structured)
        stop = stop_strings(req, ctx)
        # max_tokens 0 only needs the engine for the prompt's logprobs
        self.needs_engine = max_tokens > 0 or params.prompt_logprobs is not None
        self.choices = make_choices(ctx, raw, self.prompts, req.n, params, req, stop, accumulate=not req.stream)
        self.request_id = request_id_of(raw)
        self.id = f"cmpl-{self.request_id}"
        self.created = int(time.time())
        self.logprobs = LogprobFormatter(ctx.tokenizer)
        self.with_ids = req.return_token_ids or ctx.tokenizer is None
        # last, so nothing above can fail with sequences reserved
        self.reservation = ctx.admit(len(self.prompts) * req.n) if self.needs_engine else None

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()

    def prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.ctx.tokenizer.decode(prompt.token_ids) if self.ctx.tokenizer is not None else ""

    def usage(self) -> Usage:
        prompt_tokens, completion_tokens = usage_counts(self.prompts, self.choices)
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)

    def make_choice(self, choice: Choice, text: str, logprobs, finish_reason, stop_reason,
                    prompt_ids: list[int] | None, token_ids: list[int], prompt_logprobs=None) -> CompletionChoice:
        if prompt_logprobs is not None:
            ids = (prompt_ids, token_ids) if self.with_ids else (None, None)
            return CompletionChoiceWithPromptLogprobs(choice.index, text, logprobs, finish_reason, stop_reason, *ids,
                                                      prompt_logprobs)
        if self.with_ids:
            return CompletionChoiceWithIds(choice.index, text, logprobs, finish_reason, stop_reason, prompt_ids,
                                           token_ids)
        return CompletionChoice(choice.index, text, logprobs, finish_reason, stop_reason)

    # ------------------------------------------------------------------ whole response
    def response(self) -> CompletionResponse:
        out = []
        for choice in self.choices:
            stream = choice.output
            if not self.needs_engine:
                stream.finish_reason = "length"
            text = stream.text
            logprobs = None
            if self.echo:
                text = self.prompt_text(choice.prompt) + text
            if self.req.logprobs is not None:
                echo_ids = choice.prompt.token_ids if self.echo else None
                logprobs, _ = self.logprobs.completion(stream.logprobs, 0, echo_ids, stream.prompt_logprobs,
                                                       self.req.logprobs)
            prompt_logprobs = None
            if self.req.prompt_logprobs is not None:
                prompt_logprobs = self.logprobs.prompt_logprobs(stream.prompt_logprobs or [], self.req.prompt_logprobs)
            out.append(self.make_choice(choice, text, logprobs, stream.finish_reason, stream.stop_reason,
                                        choice.prompt.token_ids, stream.token_ids, prompt_logprobs))
        return CompletionResponse(self.id, "text_completion", self.created, self.ctx.model_name, out, self.usage())

    # ------------------------------------------------------------------ stream
    async def events(self) -> AsyncGenerator[bytes, None]:
        opts = self.req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous_usage = include_usage and opts.continuous_usage_stats
        offsets = {c.index: 0 for c in self.choices}
        started: set[int] = set()
        want_logprobs = self.req.logprobs is not None
        try:
            if self.needs_engine:
                deltas = all_deltas(self.ctx, self.choices)
            else:
                deltas = _no_generation(self.choices)
            try:
                async for choice, delta in deltas:
                    text, entries_prompt, prompt_ids = delta.text, None, None
                    if choice.index not in started:
                        started.add(choice.index)
                        prompt_ids = choice.prompt.token_ids
                        if self.echo:
                            text = self.prompt_text(choice.prompt) + text
                            entries_prompt = choice.prompt.token_ids
                    has_logprobs = want_logprobs and (delta.logprobs or entries_prompt is not None)
                    if not text and not has_logprobs and delta.finish_reason is None:
                        continue  # nothing to say yet (held-back text, a special token)
                    logprobs = None
                    if want_logprobs:
                        logprobs, offsets[choice.index] = self.logprobs.completion(
                            delta.logprobs or [], offsets[choice.index], entries_prompt, delta.prompt_logprobs,
                            self.req.logprobs)
                    usage = None
                    if continuous_usage:
                        n_prompt, n_out = len(choice.prompt.token_ids), len(choice.output.token_ids)
                        usage = Usage(n_prompt, n_out, n_prompt + n_out)
                    chunk_choice = self.make_choice(choice, text, logprobs, delta.finish_reason, delta.stop_reason,
                                                    prompt_ids, delta.token_ids)
                    yield sse_frame(CompletionResponse(self.id, "text_completion", self.created,
                                                       self.ctx.model_name, [chunk_choice], usage))
            finally:
                await deltas.aclose()
            if include_usage:
                yield sse_frame(CompletionResponse(self.id, "text_completion", self.created, self.ctx.model_name,
                                                   [], self.usage()))
        except Exception as exc:  # the response has started: report in-band, as OpenAI does
            error = error_for(exc, self.request_id)
            yield sse_frame(error_body(error.message, error.type, error.param, error.code))
        finally:
            self.release()
        yield DONE_FRAME


async def _no_generation(choices: list[Choice]):
    """max_tokens 0 without logprobs: each choice ends at once, its text is the echo (or nothing)."""
    for choice in choices:
        choice.output.finish_reason = "length"
        yield choice, StreamDelta("", [], None, None, "length")


async def create_completion(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    req = CompletionRequest.model_validate_json(body)
    check_fields(req, COMPLETION_FIELDS)
    completion = await _Completion.create(ctx, raw, req)
    if completion.req.stream:
        return SSEResponse(completion.events(), keepalive_s=ctx.sse_keepalive_s, admission=ctx.admission,
                           on_close=completion.release)
    try:
        if completion.needs_engine and not await finish_without_streaming(ctx, raw, completion.choices):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        completion.release()
    return Response(to_json(completion.response()), media_type="application/json")
