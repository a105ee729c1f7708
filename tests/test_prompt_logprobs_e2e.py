"""vLLM's ``prompt_logprobs`` and a continued final message on the whole service (``serve`` on the
tiny model, the official ``openai`` client): the numbers are the engine's (the same as ``echo`` with
``logprobs``, the same for a chat and for its rendered prompt), in vLLM's format."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import start_server, stop_server

PROMPT = [11, 12, 13, 14, 15, 16, 17]
MESSAGES = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process, base = start_server(tiny_checkpoint)
    yield base
    stop_server(process)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def check_shape(prompt_logprobs: list, prompt_ids: list[int], top_n: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], prompt_logprobs[1:]):
        assert str(token_id) in position and top_n <= len(position) <= top_n + 1
        # the top alternatives rank 1..top_n; the prompt token has its rank where the list shows it
        assert {e["rank"] for e in position.values()} - {None} >= set(range(1, top_n + 1))
        assert all(1 <= e["rank"] <= top_n for t, e in position.items() if t != str(token_id))
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in position.values())


def test_completions_prompt_logprobs_are_echos(client):
    result = client.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    prompt_logprobs = result.choices[0].model_extra["prompt_logprobs"]
    check_shape(prompt_logprobs, PROMPT, 2)
    echo = client.completions.create(model="", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    echoed = echo.choices[0].logprobs
    assert [p[str(t)]["logprob"] for t, p in zip(PROMPT[1:], prompt_logprobs[1:])] == echoed.token_logprobs[1:]
    for top, position in zip(echoed.top_logprobs[1:], prompt_logprobs[1:]):
        best = {e["decoded_token"]: e["logprob"] for e in position.values() if e["rank"] in (1, 2)}
        assert best.items() <= top.items()
    # with max_tokens 0 only the prompt's logprobs are computed
    only = client.completions.create(model="", prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert only.choices[0].text == "" and only.usage.completion_tokens == 0
    zero = only.choices[0].model_extra["prompt_logprobs"]
    assert [p[str(t)]["logprob"] for t, p in zip(PROMPT[1:], zero[1:])] == echoed.token_logprobs[1:]
    assert all(len(p) == 1 for p in zero[1:])


def test_chat_prompt_logprobs_are_those_of_the_rendered_prompt(client, server):
    reply = client.chat.completions.create(model="", messages=MESSAGES[:1], max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 1})
    ids = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES[:1]}).json()["tokens"]
    prompt_logprobs = reply.model_extra["prompt_logprobs"]
    check_shape(prompt_logprobs, ids, 1)
    plain = client.completions.create(model="", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert prompt_logprobs == plain.choices[0].model_extra["prompt_logprobs"]
    assert reply.usage.prompt_tokens == len(ids)


def test_continue_final_message_generates_after_the_prefill(client, server):
    ids = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    eos = httpx.get(f"{server}/tokenizer_info").json()["eos_token_id"]
    assert ids[-1] == eos  # the template closes the assistant's turn; continuing leaves it open
    reply = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=6, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    completion = client.completions.create(model="", prompt=ids[:-1], max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens == len(ids) - 1
    assert reply.choices[0].message.content == "Once upon" + completion.choices[0].text
    assert reply.choices[0].message.role == "assistant"
