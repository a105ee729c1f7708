"""OpenAI API request models (pydantic, validated strictly from the JSON body) and response
types (msgspec structs: encoding a streamed chunk is on the per-token path, so it must be cheap).

Requests follow OpenAI's field names and limits plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ...) and the structured-output
fields (OpenAI's ``response_format``; vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` and ``structured_outputs``; see structured_output.py). Fields not declared
here land in ``model_extra``: request_fields.py refuses the unsupported ones (400 naming them) and
logs a warning for the ones it drops, as vLLM does; nothing is silently ignored. Integers and strings are strict (``"3"`` is not a number, ``true``
is not 1); numbers given where floats are expected are fine.

Every number has both bounds (and floats must be finite), so any value JSON can express is
either accepted or refused with a 400 naming the field: nothing out of range reaches the engine
(where a 2**64 ``top_k`` used to overflow into a 500), and nothing is silently clamped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

# Field limits shared by both endpoints.
MAX_LOGPROBS = 20
MAX_N = 128
MAX_INT = 2**31 - 1  # token counts, top_k: far above any context, well inside the engine's int64
MAX_TEMPERATURE = 100.0  # far beyond any useful value (2 is OpenAI's maximum)
MAX_REPETITION_PENALTY = 100.0
MAX_LIST_ITEMS = 1024  # stop strings, stop token ids and logit_bias entries of one request
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # room for seed + choice index

OptionalFloat = float | None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(_Request):
    name: str | None = None  # OpenAI requires it; it names the schema and constrains nothing
    description: str | None = None
    schema_: Any = Field(None, alias="schema")  # checked (a JSON object) by structured_output.py
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's newer form of the ``guided_*`` fields: exactly one of them."""

    json_: Any = Field(None, alias="json")  # a schema object or its JSON text
    regex: str | None = None
    choice: Annotated[list[str] | None, Field(max_length=MAX_LIST_ITEMS)] = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Request):
    """The fields /v1/completions and /v1/chat/completions share (request_fields.py classifies
    every other field)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[OptionalFloat, Field(ge=0.0, le=MAX_TEMPERATURE)] = None  # None -> 1.0
    top_p: Annotated[OptionalFloat, Field(gt=0.0, le=1.0)] = None
    top_k: Annotated[int | None, Field(ge=-1, le=MAX_INT)] = None
    min_p: Annotated[OptionalFloat, Field(ge=0.0, le=1.0)] = None
    seed: Annotated[int | None, Field(ge=SEED_MIN, le=SEED_MAX)] = None
    presence_penalty: Annotated[OptionalFloat, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[OptionalFloat, Field(ge=-2.0, le=2.0)] = None
    repetition_penalty: Annotated[OptionalFloat, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None,
                          Field(max_length=MAX_LIST_ITEMS)] = None
    stop: str | Annotated[list[str], Field(max_length=MAX_LIST_ITEMS)] | None = None
    stop_token_ids: Annotated[list[int] | None, Field(max_length=MAX_LIST_ITEMS)] = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # structured output: at most one of these (structured_output.py maps and checks them)
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # a schema object or its JSON text
    guided_regex: str | None = None
    guided_choice: Annotated[list[str] | None, Field(max_length=MAX_LIST_ITEMS)] = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM: the prompt tokens' logprobs (and this many alternatives each); not with stream
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None


class CompletionRequest(SamplingRequest):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by serving.parse_prompts
    max_tokens: Annotated[int | None, Field(ge=0, le=MAX_INT)] = 16
    echo: bool | None = False
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    best_of: Annotated[int | None, Field(ge=1, le=MAX_N)] = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids / token_ids in each choice


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=0, le=MAX_INT)] = None  # None: up to the context length
    max_completion_tokens: Annotated[int | None, Field(ge=0, le=MAX_INT)] = None  # OpenAI's newer name, preferred
    logprobs: bool | None = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    # vLLM's chat-template options (chat_prompt.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the reply starts with the last message when it has the reply's role
    # tools are shown to the chat template; only tool_choice "none" is served (no tool calls yet)
    tools: Annotated[list[ChatTool] | None, Field(max_length=MAX_LIST_ITEMS)] = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


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


class PromptLogprob(msgspec.Struct):
    """vLLM's logprob entry: ``rank`` is 1 for the most likely token (None where not known)."""

    logprob: float
    rank: int | None
    decoded_token: str


# one entry per prompt token, keyed by token id; the first is null (nothing predicts it)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoiceWithPromptLogprobs(CompletionChoiceWithIds):
    """A whole response's choice when ``prompt_logprobs`` was asked for (vLLM)."""

    prompt_logprobs: PromptLogprobs | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM, with prompt_logprobs (whole responses only)


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "mini-deepinfer"
    root: str | None = None  # the served model name: never the server's checkpoint path


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


_json_encoder = msgspec.json.Encoder()


def to_json(value: Any) -> bytes:
    return _json_encoder.encode(value)
