"""Every request field of /v1/completions and /v1/chat/completions, classified: nothing is
silently ignored.

* implemented: a field of the request model (openai_types.py), honoured.
* rejected (400): a feature we do not support. A request that sets it is refused with a 400
  naming the field, unless its value asks for what we do anyway (``allowed``: ``suffix: ""``,
  ``use_beam_search: false``, ``function_call: "none"``, ...). ``null`` always counts as absent.
* accepted and ignored (warning): harmless to drop (``user``, ``metadata``, ...). The request is
  served; the field is named in a warning, logged once per field name per process.

A field the tables do not know (a typo such as ``tempreature``, a newer OpenAI field) is treated
as "accepted and ignored", with the same warning vLLM logs.

These tables are the single source: ``docs/api.md`` is generated from them (``python -m
frontend.request_fields > docs/api.md``) and tests/test_request_fields.py checks both the doc and
the server's behaviour against them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request

log = logging.getLogger(__name__)

IMPLEMENTED = "implemented"
REJECTED = "rejected (400)"
IGNORED = "accepted and ignored (warning)"


@dataclass(frozen=True)
class FieldSpec:
    status: str
    example: Any  # a value a request may send (for rejected fields: one that is refused)
    note: str = ""
    allowed: tuple = ()  # rejected fields: values accepted because they ask for what we do anyway
    needs: dict = field(default_factory=dict)  # other fields the example needs to make sense


def _impl(example, note="", needs=None) -> FieldSpec:
    return FieldSpec(IMPLEMENTED, example, note, needs=needs or {})


def _reject(example, note="", allowed=(), needs=None) -> FieldSpec:
    return FieldSpec(REJECTED, example, note, allowed, needs or {})


def _ignore(example, note="") -> FieldSpec:
    return FieldSpec(IGNORED, example, note)


# Fields both endpoints share: OpenAI's sampling fields and vLLM's extra sampling parameters.
_SHARED: dict[str, FieldSpec] = {
    "model": _impl("fake-model", "404 when it is not the served model name"),
    "n": _impl(2),
    "temperature": _impl(0.5),
    "top_p": _impl(0.9),
    "top_k": _impl(5, "vLLM"),
    "min_p": _impl(0.1, "vLLM"),
    "seed": _impl(3, "choice i samples with seed + i"),
    "presence_penalty": _impl(0.5),
    "frequency_penalty": _impl(0.5),
    "repetition_penalty": _impl(1.1, "vLLM"),
    "logit_bias": _impl({"5": 1.0}),
    "stop": _impl(["zz"]),
    "stop_token_ids": _impl([7], "vLLM"),
    "min_tokens": _impl(2, "vLLM"),
    "ignore_eos": _impl(True, "vLLM"),
    "include_stop_str_in_output": _impl(True, "vLLM"),
    "skip_special_tokens": _impl(False, "vLLM"),
    "stream": _impl(True),
    "stream_options": _impl({"include_usage": True}, "`include_usage`; vLLM's `continuous_usage_stats`",
                            needs={"stream": True}),
    "response_format": _impl({"type": "text"}, "`text`, `json_object`, `json_schema`"),
    "guided_json": _impl({"type": "object"}, "vLLM"),
    "guided_regex": _impl("[ab]+", "vLLM"),
    "guided_choice": _impl(["yes", "no"], "vLLM"),
    "guided_grammar": _impl('root ::= "a" | "b"', "vLLM (EBNF)"),
    "structured_outputs": _impl({"choice": ["yes", "no"]}, "vLLM"),
    "prompt_logprobs": _impl(1, "vLLM: the prompt tokens' logprobs and this many alternatives (0-20); "
                                "not with `stream`"),
    # vLLM sampling parameters we do not implement
    "use_beam_search": _reject(True, "beam search", allowed=(False,)),
    "length_penalty": _reject(0.5, "beam search only", allowed=(1.0,)),
    "truncate_prompt_tokens": _reject(8, "too long a prompt is refused instead"),
    "allowed_token_ids": _reject([1, 2]),
    "bad_words": _reject(["foo"], allowed=([],)),
    "logits_processors": _reject(["custom"]),
    "return_tokens_as_token_ids": _reject(True, allowed=(False,)),
    "spaces_between_special_tokens": _reject(False, allowed=(True,)),
    "guided_whitespace_pattern": _reject(" *"),
    "priority": _reject(1, "no priority scheduling", allowed=(0,)),
    # harmless to drop
    "user": _ignore("u-1"),
    "request_id": _ignore("r-1", "the X-Request-Id header names a request"),
    "guided_decoding_backend": _ignore("xgrammar", "xgrammar is always used"),
    "cache_salt": _ignore("salt"),
    "kv_transfer_params": _ignore({}),
    "vllm_xargs": _ignore({}),
}

_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

COMPLETION_FIELDS: dict[str, FieldSpec] = {
    "prompt": _impl("Hello", "text, token ids, or a batch of either"),
    "max_tokens": _impl(5),
    "echo": _impl(True, "with `logprobs`, the prompt's logprobs too"),
    "logprobs": _impl(2),
    "best_of": _impl(1, "only equal to `n` (400 otherwise)"),
    "return_token_ids": _impl(True, "vLLM"),
    **_SHARED,
    "suffix": _reject("!", "insertion", allowed=("",)),
    "add_special_tokens": _reject(False, "special tokens are always added to text prompts", allowed=(True,)),
    "prompt_embeds": _reject("AAAA"),
}

CHAT_FIELDS: dict[str, FieldSpec] = {
    "messages": _impl([{"role": "user", "content": "Hi"}], "text content only"),
    "max_tokens": _impl(5),
    "max_completion_tokens": _impl(5, "preferred over `max_tokens`"),
    "logprobs": _impl(True),
    "top_logprobs": _impl(2, needs={"logprobs": True}),
    "add_generation_prompt": _impl(False, "vLLM"),
    "continue_final_message": _impl(True, "vLLM: the last message is left open for the reply to continue; "
                                          "with `add_generation_prompt: false`",
                                    needs={"add_generation_prompt": False}),
    "chat_template_kwargs": _impl({"enable_thinking": True}, "vLLM: extra variables for the chat template"),
    "echo": _impl(True, "vLLM: the reply starts with the last message when that has the reply's role"),
    **_SHARED,
    "tools": _impl(_TOOLS, "shown to the chat template; only with `tool_choice: \"none\"` (no tool calls yet)",
                   needs={"tool_choice": "none"}),
    "tool_choice": _impl("none", "only `none`; other values, or `tools` without it (OpenAI's default "
                                 "`auto`), are a 400 until tool calls are served"),
    "parallel_tool_calls": _ignore(True),
    "functions": _ignore([{"name": "f", "parameters": {"type": "object"}}],
                         "deprecated `tools`; accepted only with `function_call` absent or `none`"),
    "function_call": _reject("auto", "function calling", allowed=("none",)),
    "audio": _reject({"voice": "alloy", "format": "wav"}),
    "modalities": _reject(["text", "audio"], allowed=(["text"],)),
    "prediction": _reject({"type": "content", "content": "x"}),
    "web_search_options": _reject({}),
    "reasoning_effort": _reject("low"),
    "chat_template": _reject("{{ messages }}", "vLLM"),
    "documents": _reject([{"title": "t", "text": "x"}], "vLLM"),
    "add_special_tokens": _reject(True, "the chat template writes them", allowed=(False,)),
    "metadata": _ignore({"k": "v"}),
    "store": _ignore(False),
    "service_tier": _ignore("auto"),
    "prompt_cache_key": _ignore("k"),
    "safety_identifier": _ignore("s"),
    "verbosity": _ignore("low"),
    "mm_processor_kwargs": _ignore({}),
}

ENDPOINTS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}


def _same(value, allowed) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    return value == allowed


# ----------------------------------------------------------------------------- checking a request
_warned: set[str] = set()


def warn_ignored(names) -> None:
    """vLLM's warning for fields it drops, once per field name per process."""
    new = sorted(set(names) - _warned)
    if new:
        _warned.update(new)
        log.warning("The following fields were present in the request but ignored: %s", "{" +
                    ", ".join(repr(n) for n in new) + "}")


def check_fields(req, table: dict[str, FieldSpec]) -> None:
    """Refuse the request's unsupported fields (400 naming the first) and warn about the ones it
    drops. Its undeclared fields are in ``model_extra`` (the request models allow extra fields)."""
    extra = req.model_extra or {}
    ignored = []
    for name, value in extra.items():
        spec = table.get(name)
        if spec is None or spec.status == IGNORED:
            ignored.append(name)
        elif spec.status == REJECTED:
            if value is not None and not any(_same(value, a) for a in spec.allowed):
                what = f" ({spec.note})" if spec.note and spec.note != "vLLM" else ""
                accepted = ", ".join(repr(a) for a in spec.allowed)
                hint = f"; leave it out{' or set it to ' + accepted if accepted else ''}"
                raise bad_request(f"{name}{what} is not supported yet{hint}", name)
    warn_ignored(ignored)


# ----------------------------------------------------------------------------- docs/api.md
_DOC_HEAD = """# Request fields

Every field of a `/v1/completions` or `/v1/chat/completions` request is either implemented,
rejected with a 400 whose message and `param` name it, or accepted and ignored with a warning
logged (`The following fields were present in the request but ignored: {...}`, as vLLM logs it,
once per field name per process). A rejected field is accepted when its value asks for what the
server does anyway (the "accepted values" column; `null` always counts as absent). A field not
listed here, such as a typo (`tempreature`), is accepted and ignored with the warning.

Generated from `frontend/request_fields.py` (`python -m frontend.request_fields > docs/api.md`);
tests/test_request_fields.py checks this file and the server against it.
"""


def _cell(value) -> str:
    import json

    return "`" + json.dumps(value) + "`"


def render_doc() -> str:
    lines = [_DOC_HEAD]
    for endpoint, table in ENDPOINTS.items():
        lines += [f"## `POST {endpoint}`", "", "| field | status | accepted values | notes |",
                  "|---|---|---|---|"]
        for name, spec in table.items():
            accepted = ", ".join(_cell(a) for a in spec.allowed) if spec.status == REJECTED else ""
            lines.append(f"| `{name}` | {spec.status} | {accepted} | {spec.note} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_doc(), end="")
