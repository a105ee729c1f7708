"""OpenAI API request models (pydantic, validated strictly from the JSON body) and response
types (msgspec structs: encoding a streamed chunk is on the per-token path, so it must be cheap).

Requests follow OpenAI's field names and limits plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ...). Unknown fields
are ignored, as OpenAI does. Integers and strings are strict (``"3"`` is not a number, ``true``
is not 1); numbers given where floats are expected are fine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

# Field limits shared by both endpoints.
MAX_LOGPROBS = 20
MAX_N = 128
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # room for seed + choice index

OptionalFloat = float | None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingRequest(_Request):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[OptionalFloat, Field(ge=0.0)] = None  # None -> 1.0
    top_p: Annotated[OptionalFloat, Field(gt=0.0, le=1.0)] = None
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[OptionalFloat, Field(ge=0.0, le=1.0)] = None
    seed: Annotated[int | None, Field(ge=SEED_MIN, le=SEED_MAX)] = None
    presence_penalty: Annotated[OptionalFloat, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[OptionalFloat, Field(ge=-2.0, le=2.0)] = None
    repetition_penalty: Annotated[OptionalFloat, Field(gt=0.0)] = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by serving.parse_prompts
    max_tokens: Annotated[int | None, Field(ge=0)] = 16
    echo: bool | None = False
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    best_of: Annotated[int | None, Field(ge=1)] = None
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids / token_ids in each choice


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=0)] = None  # None: up to the context length
    max_completion_tokens: Annotated[int | None, Field(ge=0)] = None  # OpenAI's newer name, preferred
    logprobs: bool | None = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses
class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended the choice


class CompletionChoiceWithIds(CompletionChoice):
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct, omit_defaults=True):
    """A whole response, or (``usage`` left out until the end) one streamed chunk."""

    id: str
    object: str  # "text_completion" for both
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "mini-deepinfer"
    root: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


_json_encoder = msgspec.json.Encoder()


def to_json(value: Any) -> bytes:
    return _json_encoder.encode(value)
