"""The offline API, shaped as vLLM's::

    from frontend.llm import LLM, SamplingParams

    llm = LLM()  # the embedded tiny model; LLM("/path/to/checkpoint", device="cuda") for a real one
    outputs = llm.generate(["Hello", "The capital of"], SamplingParams(n=2, stop=["."], max_tokens=8, seed=1))
    outputs[0].outputs[1].text
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))

With one rank (``dp_size=1``, the default) the engine core and its worker run in this process. With
``dp_size=N`` (vLLM's ``data_parallel_size=N`` is the same) the engine core stays here and starts N
worker processes over ZeroMQ, the routed experts sharded over them, exactly as ``serve`` does
(engine_core/mp_executor.py); the workers are started with the ``spawn`` method, so a script that
makes such an ``LLM`` needs vLLM's ``if __name__ == "__main__":`` guard. ``close()`` (or ``with
LLM(...) as llm:``) stops the workers and frees the model; ``del llm``, garbage collection and the
interpreter's exit do the same for an ``LLM`` that was not closed. Prompts are text (tokenized with the
checkpoint's tokenizer), token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``;
results keep the input order, one ``RequestOutput`` (outputs.py) per prompt with its ``n``
choices. Stop strings, detokenization and choice seeds work as on the server (output_stream.py,
sampling_params.py); ``chat`` renders conversations with the server's chat-template code
(chat_prompt.py). Without sampling parameters, ``generate`` and ``chat`` use the model's
``generation_config.json`` defaults (``get_default_sampling_params``), as vLLM does. The engine's
own ``engine_core.protocol.SamplingParams`` are accepted too (one choice, no stop strings).

On CUDA with one rank the worker runs on one stream of its own, made current in the thread that makes
the ``LLM`` (or adopts that thread's current stream if it is not the default one): a process that also
runs kernels on another stream replays the decode graphs slower (workers/worker_stream.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from engine_core.config import EngineConfig, EngineConfigError, check_engine_config
from engine_core.core import EngineCore
from engine_core.executor import Executor, InProcessExecutor
from engine_core.ipc import Endpoints
from engine_core.log_setup import LEVELS
from engine_core.protocol import AddRequest
from engine_core.protocol import SamplingParams as EngineSamplingParams
from engine_core.vllm_recipe_flags import RECIPE_FLAGS, check_vllm_recipe_flags

from .chat_prompt import ChatOptions, plain_messages, render_prompt
from .errors import APIError
from .generation_config import load_sampling_defaults
from .openai_types import ChatMessage
from .output_stream import OutputStream
from .outputs import CompletionOutput, Logprob, RequestOutput, to_logprobs
from .sampling_params import SamplingParams, choice_params
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["LLM", "Logprob", "PromptError", "RequestOutput", "CompletionOutput", "SamplingParams"]

Prompt = str | list[int] | dict
Params = SamplingParams | EngineSamplingParams


class PromptError(ValueError):
    """A prompt the engine refused; ``index`` is its position in the ``generate`` call."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"prompt {index}: {reason}")
        self.index, self.reason = index, reason


@dataclass(eq=False)
class _Choice:
    request_id: str
    stream: OutputStream
    error: str = ""
    done: bool = False


@dataclass(eq=False)
class _Prompt:
    """One prompt of a call: what the user asked for and its choices while they run."""

    text: str | None
    ids: list[int]
    params: SamplingParams | None  # None: the engine's own parameters were given
    engine_params: EngineSamplingParams
    choices: list[_Choice] = field(default_factory=list)
    prompt_logprobs: list | None = None


class LLM:
    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 data_parallel_size: int | None = None, hf_overrides: dict[str, Any] | str | None = None,
                 **engine_args):
        """``generation_config``: ``auto`` (the model's generation_config.json), ``vllm`` (none) or a
        directory holding one; ``data_parallel_size``: vLLM's name of ``dp_size``; ``hf_overrides``:
        values that replace config.json's (a dict, or its JSON as ``--hf-overrides`` takes it);
        ``engine_args`` are ``EngineConfig`` fields (device, dp_size, max_num_seqs, ...) and vLLM's
        recipe arguments (``trust_remote_code``, ``enable_expert_parallel``, ``tensor_parallel_size``:
        ``engine_core/vllm_recipe_flags.py``). The configuration is checked as the command line
        checks it (``EngineConfigError``) before anything starts."""
        if model is None:
            from model.checkpoint_maker import default_model_dir

            model = str(default_model_dir())
        if "generation_config" in {f.name for f in fields(EngineConfig)}:
            engine_args["generation_config"] = generation_config
        if data_parallel_size is not None:
            if engine_args.setdefault("dp_size", data_parallel_size) != data_parallel_size:
                raise ValueError(f"dp_size={engine_args['dp_size']} and data_parallel_size={data_parallel_size} "
                                 "disagree (they are the same setting)")
        try:  # vLLM's recipe arguments (trust_remote_code, ...): accepted or refused as on the command line
            check_vllm_recipe_flags({name: engine_args.pop(name) for name in RECIPE_FLAGS if name in engine_args})
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
        if hf_overrides is not None:
            engine_args["hf_overrides"] = hf_overrides if isinstance(hf_overrides, str) else json.dumps(hf_overrides)
        self.config = EngineConfig(model=str(model), **engine_args)
        check_engine_config(self.config)
        self.engine = _start_engine(self.config)
        # stops the workers on close(), on garbage collection and at the interpreter's exit, whichever
        # comes first; it holds the engine, not this object, so it does not keep the LLM alive
        self._finalizer = weakref.finalize(self, _stop_engine, self.engine)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model)
        except TokenizerError:
            self.tokenizer = None  # token-id prompts only
        self.sampling_defaults = load_sampling_defaults(model, generation_config)
        self.eos_token_id = self.engine.executor.info.eos_token_id
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the worker processes and free the model and caches (idempotent); the ``LLM`` cannot
        generate afterwards."""
        self._finalizer()
        self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.engine is None:
            raise RuntimeError("this LLM is closed")

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's defaults (generation_config.json), else the neutral ones."""
        return SamplingParams(**self.sampling_defaults)

    # ------------------------------------------------------------------ entry points
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params | Sequence[Params] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self._check_open()
        prompts = _as_prompt_list(prompts)
        inputs = []
        for index, prompt in enumerate(prompts):
            try:
                inputs.append(self._tokenize(prompt))
            except ValueError as exc:
                raise PromptError(index, str(exc)) from None
        return self._run(inputs, self._params_list(sampling_params, len(inputs)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: Params | Sequence[Params] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of such lists), rendered with the
        model's chat template as the server renders them; one ``RequestOutput`` per conversation."""
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat is not available")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = ChatOptions(add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
        inputs = []
        for index, conversation in enumerate(conversations):
            try:
                if not conversation:
                    raise ValueError("a conversation needs at least one message")
                plain = plain_messages([ChatMessage.model_validate(m) for m in conversation])
                text = render_prompt(self.tokenizer, plain, options)
            except APIError as exc:
                raise PromptError(index, exc.message) from None
            except ValueError as exc:  # pydantic's ValidationError: a malformed message
                raise PromptError(index, str(exc)) from None
            inputs.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(inputs, self._params_list(sampling_params, len(inputs)), use_tqdm)

    # ------------------------------------------------------------------ preparing
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be text, a list of token ids, or a prompt dict")
        return None, list(prompt)

    def _params_list(self, sampling_params, count: int) -> list[Params]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, EngineSamplingParams)):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"{count} prompts but {len(params)} sampling params")
        return params

    def _prepare(self, index: int, text: str | None, ids: list[int], params: Params) -> _Prompt:
        if isinstance(params, EngineSamplingParams):
            return _Prompt(text, ids, None, params)
        if (params.stop or params.structured_outputs is not None) and self.tokenizer is None:
            raise PromptError(index, "stop strings and structured output need the model's tokenizer")
        max_tokens = params.max_tokens
        if max_tokens is None:  # as many as the context leaves
            max_tokens = max(self.engine.max_model_len - len(ids), 0)
        try:
            engine_params = params.engine_params(max_tokens)
        except ValueError as exc:
            raise PromptError(index, str(exc)) from None
        return _Prompt(text, ids, params, engine_params)

    # ------------------------------------------------------------------ running
    def _run(self, inputs: list[tuple[str | None, list[int]]], params_list: list[Params],
             use_tqdm: bool) -> list[RequestOutput]:
        prompts = [self._prepare(i, text, ids, params) for i, ((text, ids), params) in enumerate(zip(inputs, params_list))]
        by_request: dict[str, tuple[_Prompt, _Choice]] = {}
        for index, prompt in enumerate(prompts):
            user = prompt.params
            for i in range(user.n if user is not None else 1):
                request_id = f"offline-{next(self._ids)}"
                stream = OutputStream(
                    self.tokenizer, prompt.ids, user.stop if user is not None else None,
                    include_stop_str=user is not None and user.include_stop_str_in_output,
                    skip_special_tokens=user is None or user.skip_special_tokens,
                    min_tokens=prompt.engine_params.min_tokens, eos_token_id=self.eos_token_id, accumulate=True)
                try:
                    self.engine.add_request(AddRequest(request_id, prompt.ids, choice_params(prompt.engine_params, i)))
                except ValueError as exc:
                    self.engine.abort(list(by_request))  # all or nothing: withdraw what is queued
                    raise PromptError(index, str(exc)) from exc
                choice = _Choice(request_id, stream)
                prompt.choices.append(choice)
                by_request[request_id] = (prompt, choice)
        progress = _progress(len(prompts), use_tqdm)
        while self.engine.has_work:
            for out in self.engine.step():
                prompt, choice = by_request.get(out.request_id, (None, None))
                if choice is None or choice.done:
                    continue  # the last outputs of a choice a stop string already ended
                delta = choice.stream.process(out)
                if out.prompt_logprobs is not None and prompt.prompt_logprobs is None:
                    prompt.prompt_logprobs = out.prompt_logprobs
                if out.error:
                    choice.error = out.error
                if delta.finish_reason is None:
                    continue
                choice.done = True
                if out.finish_reason is None:  # a stop string: the engine would go on
                    self.engine.abort([out.request_id])
                if progress is not None and all(c.done for c in prompt.choices):
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [self._result(prompt) for prompt in prompts]

    def _result(self, prompt: _Prompt) -> RequestOutput:
        logprobs_n = prompt.engine_params.logprobs
        outputs = []
        for i, choice in enumerate(prompt.choices):
            stream = choice.stream
            entries = stream.logprobs if logprobs_n is not None else None
            outputs.append(CompletionOutput(
                i, stream.text, stream.token_ids,
                sum(e.logprob for e in entries) if entries is not None else None,
                to_logprobs(entries, logprobs_n, self.tokenizer) if entries is not None else None,
                stream.finish_reason, stream.stop_reason, choice.error, entries))
        prompt_logprobs = None
        if prompt.engine_params.prompt_logprobs is not None:
            prompt_logprobs = [None, *to_logprobs(prompt.prompt_logprobs or [], prompt.engine_params.prompt_logprobs,
                                                  self.tokenizer)]
        request_id = prompt.choices[0].request_id if prompt.choices else ""
        return RequestOutput(request_id, prompt.text, prompt.ids, prompt_logprobs, outputs)


def _start_engine(config: EngineConfig) -> EngineCore:
    """The engine core in this process, over an in-process worker (one rank) or one worker process
    per DP rank (as ``serve`` starts them)."""
    if config.dp_size == 1:
        return EngineCore(config, InProcessExecutor(config))
    from engine_core.mp_executor import MultiprocExecutor

    endpoints = Endpoints.local()
    try:
        executor = MultiprocExecutor(config, endpoints, _log_level())  # stops what it started if it fails
    except BaseException:
        endpoints.cleanup()
        raise
    try:
        return EngineCore(config, executor)
    except BaseException:
        _stop_executor(executor)
        raise


def _stop_engine(engine: EngineCore) -> None:
    engine.shutdown()
    _remove_sockets(engine.executor)


def _stop_executor(executor: Executor) -> None:
    executor.shutdown()
    _remove_sockets(executor)


def _remove_sockets(executor: Executor) -> None:
    endpoints = getattr(executor, "endpoints", None)  # the worker processes' socket directory
    if endpoints is not None:
        endpoints.cleanup()


def _log_level() -> str:
    """The workers log at this process's level (a level without a standard name: INFO)."""
    name = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return name if name in LEVELS else "INFO"


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single token-id prompt
    return prompts


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="prompt", file=sys.stderr)
