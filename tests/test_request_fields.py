"""Every request field of /v1/completions and /v1/chat/completions behaves as
frontend/request_fields.py classifies it, and docs/api.md is that classification."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from frontend import request_fields
from frontend.openai_types import ChatCompletionRequest, CompletionRequest
from frontend.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED, IMPLEMENTED, REJECTED

pytest.importorskip("xgrammar")  # the guided_* examples compile a grammar

MODEL = "fake-model"
DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BASE = {"/v1/completions": {"model": MODEL, "prompt": "Hello there", "max_tokens": 4},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
TABLES = {"/v1/completions": (COMPLETION_FIELDS, CompletionRequest),
          "/v1/chat/completions": (CHAT_FIELDS, ChatCompletionRequest)}
CASES = [(endpoint, name) for endpoint, (table, _) in TABLES.items() for name in table]
WARNING = "The following fields were present in the request but ignored"


def test_doc_is_generated_from_the_table():
    assert DOC.read_text() == request_fields.render_doc(), \
        "docs/api.md is stale: python -m frontend.request_fields > docs/api.md"


@pytest.mark.parametrize("endpoint", TABLES)
def test_implemented_fields_are_the_declared_ones(endpoint):
    table, model = TABLES[endpoint]
    implemented = {name for name, spec in table.items() if spec.status == IMPLEMENTED}
    assert implemented == set(model.model_fields)
    assert all(spec.status in (IMPLEMENTED, REJECTED, IGNORED) for spec in table.values())
    assert all(spec.allowed == () for spec in table.values() if spec.status != REJECTED)


def post(served, endpoint: str, **fields) -> httpx.Response:
    return httpx.post(served[0].url + endpoint, json={**BASE[endpoint], **fields}, timeout=30)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


# Where cheap, the effect of an implemented field on the (non-streamed) response.
EFFECTS = {
    "n": lambda r: len(r["choices"]) == 2,
    "max_tokens": lambda r: r["usage"]["completion_tokens"] == 5,
    "max_completion_tokens": lambda r: r["usage"]["completion_tokens"] == 5,
    "logprobs": lambda r: r["choices"][0]["logprobs"] is not None,
    "top_logprobs": lambda r: len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2,
    "return_token_ids": lambda r: r["choices"][0]["token_ids"],
    "stop_token_ids": lambda r: all(c["finish_reason"] in ("length", "stop") for c in r["choices"]),
}
ENDPOINT_EFFECTS = {
    ("/v1/completions", "echo"): lambda r: r["choices"][0]["text"].startswith("Hello there"),
    ("/v1/completions", "prompt_logprobs"): lambda r: r["choices"][0]["prompt_logprobs"][0] is None
    and len(r["choices"][0]["prompt_logprobs"]) == r["usage"]["prompt_tokens"],
    ("/v1/chat/completions", "prompt_logprobs"): lambda r: r["prompt_logprobs"][0] is None
    and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"],
    ("/v1/chat/completions", "continue_final_message"): lambda r: r["choices"][0]["message"]["role"] == "user",
}


@pytest.mark.parametrize("endpoint,name", CASES, ids=[f"{'chat' if 'chat' in e else 'completions'}-{n}" for e, n in CASES])
def test_field(served, caplog, endpoint, name):
    spec = TABLES[endpoint][0][name]
    request_fields._warned.clear()
    caplog.set_level(logging.WARNING, logger="frontend.request_fields")
    fields = {**spec.needs, name: spec.example}
    r = post(served, endpoint, **fields)
    if spec.status == IMPLEMENTED:
        assert r.status_code == 200, r.text
        assert not warnings_of(caplog)
        stream = bool(fields.get("stream"))
        if stream:
            assert "data: [DONE]" in r.text
        else:
            effect = ENDPOINT_EFFECTS.get((endpoint, name), EFFECTS.get(name))
            if effect is not None:
                assert effect(r.json()), r.text
    elif spec.status == REJECTED:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == name and name in error["message"]
        for value in (None, *spec.allowed):  # values that ask for what the server does anyway
            ok = post(served, endpoint, **{**spec.needs, name: value})
            assert ok.status_code == 200, ok.text
        assert not warnings_of(caplog)
    else:
        assert r.status_code == 200, r.text
        (message,) = warnings_of(caplog)
        assert repr(name) in message
        caplog.clear()
        assert post(served, endpoint, **fields).status_code == 200
        assert not warnings_of(caplog)  # once per field name per process


@pytest.mark.parametrize("endpoint", TABLES)
def test_unknown_field_is_a_warning(served, caplog, endpoint):
    request_fields._warned.clear()
    caplog.set_level(logging.WARNING, logger="frontend.request_fields")
    r = post(served, endpoint, tempreature=0.0, seed=1)
    assert r.status_code == 200, r.text
    (message,) = warnings_of(caplog)
    assert "'tempreature'" in message


def test_tools_need_tool_choice_none(served):
    tools = CHAT_FIELDS["tools"].example
    assert post(served, "/v1/chat/completions", tools=tools, tool_choice="none").status_code == 200
    assert post(served, "/v1/chat/completions", tool_choice="none").status_code == 200
    # without tool_choice, tools mean OpenAI's default "auto": refused until tool calls are served
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        fields = {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
        r = post(served, "/v1/chat/completions", **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "tool_choice" in r.json()["error"]["message"] and "not supported yet" in r.json()["error"]["message"]
