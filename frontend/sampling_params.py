"""``SamplingParams`` of the offline API (``LLM.generate``, ``LLM.chat``), shaped as vLLM's.

It holds what a user asks for, the server's request knobs included: the number of choices ``n``,
stop strings and what to do with them, detokenization options and the constraint, besides what the
engine needs. ``engine_params`` converts it into the engine's ``engine_core.protocol.SamplingParams``
(the per-sequence part that crosses the process boundary); stop strings, ``n`` and detokenization
stay in the frontend (output_stream.py), as on the server.

Values are checked when the object is made: a bad one is a ValueError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_core.protocol import SamplingParams as EngineSamplingParams
from engine_core.protocol import StructuredOutput

from .openai_types import MAX_LOGPROBS, MAX_N, SEED_MAX, SEED_MIN, StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1  # choices per prompt (choice i samples with seed + i when a seed is given)
    best_of: int | None = None  # only equal to n (no beam search / best-of selection)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings (the text ends before them)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as the context leaves
    min_tokens: int = 0
    logprobs: int | None = None  # the sampled token's logprob and this many alternatives per position
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # structured output: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": True}, or a frontend.openai_types.StructuredOutputsParams
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) is not supported: leave it out or set it equal to n ({self.n})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
            for t in self.stop_token_ids:
                _check_int("stop_token_ids", t, 0, 2**31 - 1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_int("top_k", self.top_k, -1, 2**31 - 1)
        _check_int("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, 2**31 - 1)
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token, 0, 2**31 - 1)
                _check_float("logit_bias value", bias, -100.0, 100.0)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.model_validate(self.structured_outputs)
        # the engine's own checks (top_p, min_p, repetition_penalty, ...), with their messages
        self.engine_params(self.max_tokens or 0)

    def engine_params(self, max_tokens: int) -> EngineSamplingParams:
        """The engine's parameters for the first choice of a prompt (``choice_params`` for the others)."""
        return EngineSamplingParams(
            temperature=float(self.temperature), top_p=float(self.top_p), top_k=self.top_k, min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            seed=self.seed, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            structured=self.structured())

    def structured(self) -> StructuredOutput | None:
        """The constraint as the engine takes it, checked as the server checks it (ValueError)."""
        if self.structured_outputs is None:
            return None
        from .errors import APIError
        from .openai_types import SamplingRequest
        from .structured_output import structured_from_request

        try:
            return structured_from_request(SamplingRequest(structured_outputs=self.structured_outputs))
        except APIError as exc:
            raise ValueError(exc.message) from None


def choice_params(params: EngineSamplingParams, choice_in_prompt: int) -> EngineSamplingParams:
    """With a seed, choice i samples with seed + i: choices differ but stay reproducible.
    Without one the engine draws a random seed per request."""
    if params.seed is None or choice_in_prompt == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + choice_in_prompt)


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
