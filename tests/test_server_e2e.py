"""Black-box tests of the whole service: ``mini-deepinfer serve`` as a subprocess (frontend, engine
core and a worker process on the tiny model), driven by the official ``openai`` client.

The frontend's behaviour in detail is covered against a fake engine in test_frontend_*.py; these
tests prove the real processes together keep the promises: identical text streaming or not,
exact usage, logprobs consistent with echo, clear errors with the server still serving, and
disconnects returning every running request, KV block and state slot.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from server_harness import start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process, base = start_server(tiny_checkpoint, max_num_seqs=8)
    yield base
    stop_server(process)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(minideepinfer:[a-z_]+)\{[^}]*\} ([0-9.e+-]+)$", text, re.M)}


def _wait_idle(base: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        if (m["minideepinfer:num_requests_running"] == m["minideepinfer:num_requests_waiting"] ==
                m["minideepinfer:kv_blocks_used"] == m["minideepinfer:state_slots_used"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {m}")
        time.sleep(0.1)


def test_streaming_equals_non_streaming_and_usage_is_exact(client):
    kwargs = dict(model="", prompt="The engine schedules", max_tokens=20, temperature=0.8, seed=42)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == full.usage.completion_tokens == 20
    tokenized = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": kwargs["prompt"]}).json()
    assert full.usage.prompt_tokens == tokenized["count"]


def test_n_choices_and_token_id_prompts(client):
    result = client.completions.create(model="", prompt=[[5, 6, 7, 8], [9, 10]], n=2, max_tokens=5, temperature=1.0,
                                       seed=3)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 6 and result.usage.completion_tokens == 20


def test_echo_logprobs_for_lm_eval(client):
    ids = [11, 12, 13, 14, 15, 16]
    result = client.completions.create(model="", prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    # the generated token's logprob is the same whether or not the prompt is echoed
    plain = client.completions.create(model="", prompt=ids, max_tokens=1, logprobs=1, temperature=0)
    assert plain.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[-1], abs=1e-6)


def test_chat_completion(client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="", messages=messages, max_tokens=12, seed=9, temperature=0.5)
    streamed = list(client.chat.completions.create(model="", messages=messages, max_tokens=12, seed=9,
                                                   temperature=0.5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"


def test_errors_are_openai_envelopes_and_the_server_keeps_serving(client, server):
    bad = [dict(prompt="x", max_tokens=5, temperature=-1),
           dict(prompt=[999999], max_tokens=5),
           dict(prompt=list(range(1, 200)), max_tokens=10**6),
           dict(prompt="x", max_tokens=5, best_of=3)]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="", **kwargs)
        body = info.value.response.json()
        assert set(body["error"]) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert client.completions.create(model="", prompt="still alive", max_tokens=3).choices[0].finish_reason
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks_and_slots(server, stream):
    body = {"prompt": list(range(5, 100)), "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=5) as http:
        if stream:
            with http.stream("POST", f"{server}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        break  # got a first token: now hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server}/v1/completions", json=body, timeout=1.5)
    metrics = _wait_idle(server)
    assert metrics["minideepinfer:kv_blocks_total"] > 0 and metrics["minideepinfer:state_slots_total"] > 0
