"""Property-based fuzzing of the JSON endpoints: random bodies, and random values of the right and
wrong types in every field, never get a 5xx, and the server stays healthy.

Requests are sent in-process through the ASGI app (httpx's ASGITransport): the whole app runs,
middleware included, without a socket per example, so a few hundred examples take seconds.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.fake_engine import fake_engine_for
from frontend.server import build_app

# every JSON value, small
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10)
token_ids = st.lists(st.integers(min_value=-5, max_value=2**64), min_size=0, max_size=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=30) | json_values}), max_size=3)
numbers = st.integers(min_value=-(2**66), max_value=2**66) | st.floats(allow_nan=False, allow_infinity=False)

FIELDS = {
    "prompt": st.text(max_size=40) | token_ids | st.lists(st.text(max_size=10), max_size=3) | st.lists(token_ids,
                                                                                                        max_size=3),
    "messages": messages, "tokens": token_ids,
    "max_tokens": numbers, "max_completion_tokens": numbers, "n": numbers, "temperature": numbers,
    "top_p": numbers, "top_k": numbers, "min_p": numbers, "seed": numbers, "presence_penalty": numbers,
    "frequency_penalty": numbers, "repetition_penalty": numbers, "min_tokens": numbers, "logprobs": numbers | st.booleans(),
    "top_logprobs": numbers, "best_of": numbers, "echo": st.booleans(),
    "logit_bias": st.dictionaries(st.text(max_size=25) | st.integers().map(str), numbers, max_size=3),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3), "stop_token_ids": token_ids,
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans(),
}
KEYS = sorted(FIELDS)
# some fields with values of their own kind, then some with any JSON value at all (wrong types)
typed_bodies = st.lists(st.sampled_from(KEYS), max_size=8, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))
wild_bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4)
mixed_bodies = st.tuples(typed_bodies, wild_bodies).map(lambda pair: {**pair[0], **pair[1]})
any_body = typed_bodies | mixed_bodies | json_values
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


@pytest.fixture(scope="module")
def app_client(tokenizer):
    engine = fake_engine_for(tokenizer, max_model_len=256)
    app = build_app(engine, tokenizer, "fuzz", None, [], 64)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")
    loop.run_until_complete(engine.start())
    yield loop, client
    loop.run_until_complete(client.aclose())
    loop.run_until_complete(engine.shutdown())
    loop.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(path=PATHS, body=any_body)
def test_fuzz_never_5xx(app_client, path, body):
    loop, client = app_client
    if isinstance(body, dict) and body.get("max_tokens") is not None and isinstance(body.get("max_tokens"), int):
        body = {**body, "max_tokens": min(body["max_tokens"], 8)}  # keep generation short (still validated)
    r = loop.run_until_complete(client.post(path, json=body))
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "internal server error" not in r.text  # not in-band in a stream either
    health = loop.run_until_complete(client.get("/health"))
    assert health.status_code == 200
