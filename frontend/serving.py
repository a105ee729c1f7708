"""What /v1/completions and /v1/chat/completions share: the serving context, input checks,
sampling parameters, and running a request's choices against the engine.

A request fans out into one engine request per choice (prompt x ``n``). ``choice_deltas`` runs
one of them: it feeds the engine's outputs through the choice's ``OutputStream`` and closes the
engine generator (which aborts the engine request) as soon as the choice is done from the
client's point of view: a stop string matched, the consumer went away, or an error. ``all_deltas``
interleaves several choices as their outputs arrive.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from engine_core.protocol import SamplingParams, StructuredOutput

from .admission import Admission, Reservation
from .engine_client import EngineClientBase, QueueFullError
from .errors import APIError, bad_request
from .generation_config import load_sampling_defaults
from .metrics import FrontendMetrics, RequestTimer
from .openai_types import SamplingRequest
from .output_stream import OutputStream, StreamDelta
from .sampling_params import choice_params
from .tokenizer import Tokenizer


# A text prompt longer than max_model_len * this many characters cannot fit the context with any
# tokenizer we serve (a BPE token averages ~4 characters; even long whitespace runs stay far
# below 32): it is refused before tokenizing, so an oversized prompt costs no tokenizer time.
MAX_CHARS_PER_TOKEN = 32


@dataclass
class ServingContext:
    engine: EngineClientBase
    tokenizer: Tokenizer | None
    model_name: str
    admission: Admission
    sse_keepalive_s: float = 15.0  # a ": keep-alive" comment this often while a stream waits
    metrics: FrontendMetrics = None  # type: ignore[assignment]
    # default sampling parameters (generation_config.py); None: read the generation_config.json of
    # the model directory the tokenizer came from
    sampling_defaults: dict | None = None
    served_model_names: tuple[str, ...] = ()  # more names ``model`` may give (--served-model-name)
    pending_first_output: int = 0  # engine requests sent that have not produced an output yet
    _request_counter: itertools.count = field(default_factory=itertools.count)
    _grammar_validator: object = None  # structured_output.GrammarValidator, made at first use

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = FrontendMetrics(self.engine, lambda: self.pending_first_output)
        if self.sampling_defaults is None:
            model_dir = getattr(self.tokenizer, "model_dir", None)
            self.sampling_defaults = load_sampling_defaults(model_dir) if model_dir is not None else {}

    def grammar_validator(self):
        """The server's structured-output validator (one xgrammar compiler and cache), or None
        without xgrammar or a tokenizer."""
        if self._grammar_validator is None and self.tokenizer is not None:
            from .structured_output import GrammarValidator, xgrammar_available

            if xgrammar_available():
                self._grammar_validator = GrammarValidator(self.tokenizer, self.vocab_size,
                                                           self.engine.info.eos_token_id)
        return self._grammar_validator

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def require_tokenizer(self, what: str, param: str | None = None) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what} is not available; send token ids", param)
        return self.tokenizer

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context, before spending any time tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"{param} is {num_chars} characters long; it cannot fit this model's context of "
                              f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters are "
                              "accepted)", param)

    def admit(self, num_engine_requests: int) -> Reservation:
        """Reserve the request's engine sequences (see admission.py), or refuse it (400/503)."""
        try:
            return self.admission.reserve(num_engine_requests)
        except APIError as exc:
            if exc.status == 503:
                self.metrics.rejected.inc()
            raise

    def engine_request_id(self, request_id: str) -> str:
        """A base engine id for one HTTP request; unique even when clients reuse X-Request-Id."""
        return f"{request_id}-{next(self._request_counter)}"


def request_id_of(raw: Request) -> str:
    """The X-Request-Id the middleware settled on (the client's, or a generated one)."""
    state = raw.scope.get("state") or {}
    return state.get("request_id") or uuid.uuid4().hex


# ----------------------------------------------------------------------------- inputs
@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None  # as the client sent it (None for token ids)


_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


async def parse_prompts(value, ctx: ServingContext, n: int) -> list[PromptInput]:
    """The prompts, tokenized. Their number (x ``n``) and text lengths are checked first, so an
    oversized request is refused without tokenizing anything."""
    if value is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        items = value
    elif isinstance(value, list) and value and _is_token_list(value):
        items = [value]
    elif isinstance(value, list) and value and all(_is_token_list(v) for v in value):
        items = value
    elif isinstance(value, list) and not value:
        raise bad_request("prompt must not be empty", "prompt")
    else:
        raise bad_request(f"prompt must be {_PROMPT_SHAPES}", "prompt")
    ctx.admission.check_size(len(items) * n)
    for item in items:
        if isinstance(item, str):
            ctx.check_text_length(len(item), "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            ids = await ctx.require_tokenizer("a text prompt", "prompt").encode_async(item)
            prompts.append(PromptInput(ids, item))
        else:
            check_token_ids(item, ctx.vocab_size, "prompt")
            prompts.append(PromptInput(list(item), None))
    return prompts


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} in {param} is out of range [0, {vocab_size})", param)


def check_context_length(ctx: ServingContext, num_prompt_tokens: int, max_tokens: int) -> None:
    total = num_prompt_tokens + max_tokens
    if total > ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or of the completion.", "max_tokens")


def stop_strings(req: SamplingRequest, ctx: ServingContext) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop = [s for s in stop if s]
    if stop:
        ctx.require_tokenizer("stop strings", "stop")
    return stop


def default_max_tokens(ctx: ServingContext, requested: int) -> int:
    """``max_tokens`` capped by the model's default (generation_config.json), as vLLM does."""
    default = ctx.sampling_defaults.get("max_tokens")
    return requested if default is None else min(requested, int(default))


def build_params(req: SamplingRequest, ctx: ServingContext, *, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None, structured: StructuredOutput | None = None) -> SamplingParams:
    """The engine's sampling parameters of the request's first choice (``seed`` shifts per choice).
    A sampling knob the request leaves out takes the model's default (generation_config.json),
    else the neutral value."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options may only be set when stream is true", "stream_options")
    if req.prompt_logprobs is not None:
        if req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    stop_token_ids = tuple(req.stop_token_ids or ())
    for t in stop_token_ids:
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(f"stop token id {t} is out of range [0, {ctx.vocab_size})", "stop_token_ids")
    logit_bias = None
    if req.logit_bias:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < ctx.vocab_size:
                raise bad_request(f"logit_bias token id {token} is out of range [0, {ctx.vocab_size})", "logit_bias")
            logit_bias[token] = float(bias)
    defaults = ctx.sampling_defaults

    def given(name: str, neutral):
        value = getattr(req, name)
        return defaults.get(name, neutral) if value is None else value

    try:
        return SamplingParams(
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
            min_p=given("min_p", 0.0), presence_penalty=given("presence_penalty", 0.0),
            frequency_penalty=given("frequency_penalty", 0.0),
            repetition_penalty=given("repetition_penalty", 1.0), logit_bias=logit_bias, seed=req.seed,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop_token_ids=stop_token_ids, ignore_eos=req.ignore_eos,
            structured=structured)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


# ----------------------------------------------------------------------------- running choices
@dataclass(eq=False)
class Choice:
    index: int  # prompt_index * n + i
    prompt: PromptInput
    engine_request_id: str
    params: SamplingParams
    output: OutputStream
    timer: RequestTimer


def make_choices(ctx: ServingContext, raw: Request, prompts: list[PromptInput], n: int, params: SamplingParams,
                 req: SamplingRequest, stop: list[str], *, accumulate: bool) -> list[Choice]:
    base = ctx.engine_request_id(request_id_of(raw))
    now, now_wall = time.monotonic(), time.time()
    choices = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            output = OutputStream(ctx.tokenizer, prompt.token_ids, stop, include_stop_str=req.include_stop_str_in_output,
                                  skip_special_tokens=req.skip_special_tokens, min_tokens=req.min_tokens,
                                  eos_token_id=ctx.engine.info.eos_token_id, accumulate=accumulate)
            choices.append(Choice(index, prompt, f"{base}-{index}", choice_params(params, i), output,
                                  RequestTimer(ctx.metrics, now, now_wall)))
    return choices


async def _close(generator) -> None:
    aclose = getattr(generator, "aclose", None)
    if aclose is not None:
        await aclose()


async def choice_deltas(ctx: ServingContext, choice: Choice) -> AsyncIterator[StreamDelta]:
    """One choice's deltas. The engine generator is closed (aborting the engine request if it
    still runs) before the final delta is handed out, and in every other way out of here."""
    ctx.pending_first_output += 1
    waiting_first = True
    generator = ctx.engine.generate(choice.engine_request_id, choice.prompt.token_ids, choice.params)
    try:
        async for output in generator:
            if waiting_first:
                ctx.pending_first_output -= 1
                waiting_first = False
            choice.timer.on_output(output)
            delta = choice.output.process(output)
            if delta.finish_reason is not None:
                await _close(generator)  # a stop string: abort the engine request now
                choice.timer.on_finish(delta.finish_reason)
                yield delta
                return
            yield delta
    except QueueFullError:
        ctx.metrics.rejected.inc()
        choice.timer.done = True  # rejected, not aborted
        raise
    finally:
        if waiting_first:
            ctx.pending_first_output -= 1
        choice.timer.on_abort()  # no-op when finished
        await _close(generator)


async def all_deltas(ctx: ServingContext, choices: list[Choice]) -> AsyncIterator[tuple[Choice, StreamDelta]]:
    """The deltas of all choices, in arrival order. Closing this (or cancelling its consumer)
    closes every choice, so no engine request outlives the HTTP request."""
    if len(choices) == 1:  # the common case, without tasks
        choice = choices[0]
        deltas = choice_deltas(ctx, choice)
        try:
            async for delta in deltas:
                yield choice, delta
        finally:
            await deltas.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice) -> None:
        deltas = choice_deltas(ctx, choice)
        try:
            async for delta in deltas:
                queue.put_nowait((choice, delta))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((choice, exc))
        finally:
            await deltas.aclose()
            queue.put_nowait((choice, done))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_to_end(ctx: ServingContext, choices: list[Choice]) -> None:
    """Drive every choice to its end (non-streaming); the outputs accumulate in the choices."""
    deltas = all_deltas(ctx, choices)
    try:
        async for _ in deltas:
            pass
    finally:
        await deltas.aclose()


def usage_counts(prompts: list[PromptInput], choices: list[Choice]) -> tuple[int, int]:
    """(prompt tokens counted once per prompt whatever n, completion tokens of all choices)."""
    return sum(len(p.token_ids) for p in prompts), sum(len(c.output.token_ids) for c in choices)


async def finish_without_streaming(ctx: ServingContext, raw: Request, choices: list[Choice]) -> bool:
    """Run a non-streaming request's choices to the end. False if the client went away first (its
    engine requests are then aborted); engine errors become API errors, and a drain deadline a 503."""
    from .disconnect import ClientDisconnected, run_until_disconnect
    from .errors import error_for

    try:
        await run_until_disconnect(raw, run_to_end(ctx, choices), ctx.admission)
    except ClientDisconnected:
        return False
    except Exception as exc:
        raise error_for(exc, request_id_of(raw)) from None
    return True
