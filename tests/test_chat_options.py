"""vLLM's chat options through the real HTTP server and the official ``openai`` client:
``chat_template_kwargs``, ``tools`` with ``tool_choice: "none"``, ``continue_final_message``,
``add_generation_prompt``, ``echo``; ``prompt_logprobs`` refused when streaming; and the model's
generation_config.json as default sampling parameters.

The engine is the fake one (its ``received`` record shows exactly which prompt tokens and sampling
parameters reached it); the tokenizer is the embedded model's with a chat template that shows the
tools and an ``enable_thinking`` variable in the prompt.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from frontend.fake_engine import serve_fake
from frontend.tokenizer import Tokenizer
from model.checkpoint_maker import default_model_dir

TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}[TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]{%- endif -%}"
    "{%- if enable_thinking is defined and enable_thinking -%}[THINK]{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '<｜User｜>' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<｜Assistant｜>' + m['content'] + eos_token -}}"
    "{%- else -%}{{- m['content'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}")
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.6, "top_k": 7, "max_new_tokens": 6}
USER = [{"role": "user", "content": "Tell me a story"}]
PREFILL = USER + [{"role": "assistant", "content": "Once upon a time "}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat-options")
    source = default_model_dir()
    shutil.copy(source / "tokenizer.json", directory)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return directory


@pytest.fixture(scope="module")
def served(model_dir):
    tokenizer = Tokenizer(model_dir)
    with serve_fake(tokenizer, model_name="m") as (server, engine):
        yield server, engine, tokenizer


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="none", max_retries=0)


def last_received(served) -> tuple[str, object]:
    """The prompt text (special tokens written out) and the sampling parameters of the newest request."""
    _, engine, tokenizer = served
    ids, params = list(engine.received.values())[-1]
    return tokenizer.decode(ids, skip_special_tokens=False), params


def chat(client, messages=USER, **extra):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=3, extra_body=extra or None)


def bad_request(client, param: str, **fields) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=fields.pop("messages", USER), max_tokens=3,
                                       extra_body=fields)
    error = info.value.body
    assert error["param"] == param, error
    return error["message"]


def test_chat_template_kwargs_reach_the_template(client, served):
    chat(client, chat_template_kwargs={"enable_thinking": True})
    assert last_received(served)[0] == "<｜begin▁of▁sentence｜>[THINK]<｜User｜>Tell me a story<｜Assistant｜>"
    chat(client, chat_template_kwargs={"enable_thinking": False})
    assert "[THINK]" not in last_received(served)[0]
    for reserved in ("messages", "add_generation_prompt", "tools", "bos_token"):
        assert reserved in bad_request(client, "chat_template_kwargs", chat_template_kwargs={reserved: 1})


def test_tools_reach_the_template_with_tool_choice_none(client, served):
    reply = client.chat.completions.create(model="m", messages=USER, max_tokens=3, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    assert last_received(served)[0].startswith("<｜begin▁of▁sentence｜>[TOOLS get_weather]<｜User｜>")
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, max_tokens=3, tools=TOOLS, tool_choice=choice)
        assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's default with tools is "auto"
        client.chat.completions.create(model="m", messages=USER, max_tokens=3, tools=TOOLS)
    assert info.value.body["param"] == "tool_choice" and "auto" in info.value.body["message"]


def test_continue_final_message_leaves_it_open(client, served):
    reply = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True)
    prompt, _ = last_received(served)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Tell me a story<｜Assistant｜>Once upon a time "
    assert reply.choices[0].message.role == "assistant"
    assert "add_generation_prompt" in bad_request(client, "continue_final_message", messages=PREFILL,
                                                  continue_final_message=True)
    empty = USER + [{"role": "assistant", "content": ""}]
    bad_request(client, "continue_final_message", messages=empty, add_generation_prompt=False,
                continue_final_message=True)


def test_add_generation_prompt_false(client, served):
    reply = chat(client, add_generation_prompt=False)
    assert last_received(served)[0] == "<｜begin▁of▁sentence｜><｜User｜>Tell me a story"
    assert reply.choices[0].message.role == "user"  # vLLM: the role of the message it continues


def test_echo_prepends_the_last_message_of_the_replys_role(client, served):
    plain = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True, seed=4)
    echoed = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True, seed=4, echo=True)
    assert echoed.choices[0].message.content == "Once upon a time " + plain.choices[0].message.content
    stream = client.chat.completions.create(model="m", messages=PREFILL, max_tokens=3, stream=True, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "seed": 4, "echo": True})
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert pieces[0] == "Once upon a time " and "".join(pieces) == echoed.choices[0].message.content
    # after a generation prompt the reply is the assistant's and the last message the user's: nothing to echo
    assert chat(client, seed=4, echo=True).choices[0].message.content == chat(client, seed=4).choices[0].message.content


def test_prompt_logprobs_are_not_streamed(client):
    for create in (lambda **kw: client.completions.create(model="m", prompt="Hi", **kw),
                   lambda **kw: client.chat.completions.create(model="m", messages=USER, **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            list(create(max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}))
        assert info.value.body["param"] == "prompt_logprobs"


def test_generation_config_supplies_the_defaults(client, served):
    chat(client)
    _, params = last_received(served)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 7, 1.0, 3)
    client.chat.completions.create(model="m", messages=USER, temperature=1.2, extra_body={"top_k": 2})
    _, params = last_received(served)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.2, 2, 6)  # max_tokens capped by the default
    client.completions.create(model="m", prompt="Hello", max_tokens=50)
    assert last_received(served)[1].max_tokens == 6
