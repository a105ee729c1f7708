"""Offline generation: ``LLM(model=None, **engine_args).generate(prompts, sampling_params)``.

Runs the engine core and one worker in this process. Prompts are text (tokenized with the
checkpoint's tokenizer) or token ids; results keep the input order.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Sequence

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.executor import InProcessExecutor
from engine_core.protocol import AddRequest, SamplingParams, TokenLogprob

from .tokenizer import Tokenizer, TokenizerError

Prompt = str | list[int]


class PromptError(ValueError):
    """A prompt the engine refused; ``index`` is its position in the ``generate`` call."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"prompt {index}: {reason}")
        self.index, self.reason = index, reason


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str = ""  # why the engine ended the request (e.g. a structured-output spec that does not compile)


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        if model is None:
            from model.checkpoint_maker import default_model_dir

            model = str(default_model_dir())
        self.config = EngineConfig(model=str(model), **engine_args)
        self.engine = EngineCore(self.config, InProcessExecutor(self.config))
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model)
        except TokenizerError:
            self.tokenizer = None  # token-id prompts only
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[GenerationResult]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results: dict[str, GenerationResult] = {}
        order = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = f"offline-{next(self._ids)}"
            try:
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("this checkpoint has no tokenizer: pass token ids")
                    ids, text = self.tokenizer.encode(prompt), prompt
                else:
                    ids, text = list(prompt), None
                self.engine.add_request(AddRequest(request_id, ids, params))
            except ValueError as exc:
                self.engine.abort(order)  # all or nothing: withdraw the prompts already queued
                raise PromptError(index, str(exc)) from exc
            results[request_id] = GenerationResult(request_id, text, ids, [], "", None)
            order.append(request_id)
        progress = _progress(len(order), use_tqdm)
        while self.engine.has_work:
            for out in self.engine.step():
                result = results[out.request_id]
                result.token_ids.extend(out.new_token_ids)
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.error:
                    result.error = out.error
                if out.finish_reason is not None:
                    result.finish_reason = out.finish_reason
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        for result in results.values():
            if self.tokenizer is not None:
                result.text = self.tokenizer.decode(result.token_ids)
        return [results[r] for r in order]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    return prompts


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req", file=sys.stderr)
