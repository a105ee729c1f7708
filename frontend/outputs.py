"""What the offline API returns, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput`` /
``Logprob``: one ``RequestOutput`` per prompt, holding its ``n`` choices in ``outputs``.

Logprobs are vLLM's: per position a dict token id -> ``Logprob(logprob, rank, decoded_token)``
holding the chosen token and the top alternatives asked for; ``prompt_logprobs`` start with
``None`` (nothing predicts the first prompt token). ``rank`` is None where the engine's top-N list
does not show it (see logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.protocol import TokenLogprob

from .logprobs import ranked
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # the choice's index among its prompt's n
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the chosen tokens' logprobs, when logprobs were asked for
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id (not eos) that ended it
    error: str = ""  # why the engine ended it (finish_reason "abort"), e.g. a constraint that does not compile
    # the engine's own entries behind ``logprobs`` (TokenLogprob: token_id, logprob, top_ids, top_logprobs)
    token_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt text (for chat: the rendered conversation); None for token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True

    # Before the vLLM shape, ``generate`` returned one flat result per prompt; these keep that
    # access working for the first choice.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str:
        return self.outputs[0].error

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The first choice's engine entries (``outputs[0].logprobs`` has them in vLLM's form)."""
        return self.outputs[0].token_logprobs


def to_logprobs(entries: list[TokenLogprob], top_n: int, tokenizer: Tokenizer | None) -> SampleLogprobs:
    """The engine's entries as vLLM's per-position dicts."""
    def decoded(token_id: int) -> str | None:
        return tokenizer.token_string(token_id) if tokenizer is not None else None

    return [{token_id: Logprob(logprob, rank, decoded(token_id)) for token_id, logprob, rank in ranked(entry, top_n)}
            for entry in entries]
