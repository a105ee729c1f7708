"""Every bad request gets the right status and OpenAI's error envelope, and the server keeps
serving; auth, CORS, X-Request-Id; a model without tokenizer or chat template."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from frontend.fake_engine import serve_fake
from frontend.tokenizer import Tokenizer
from model.checkpoint_maker import default_model_dir

MODEL = "fake-model"
OK_CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url) as client:
        yield client


def assert_envelope(response: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                    contains: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert contains in error["message"]
    return error


TOO_LONG = [5 + i % 1000 for i in range(4000)]

COMPLETION_ERRORS = [
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": [[5, 6], [-1]]}, "prompt"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
]


@pytest.mark.parametrize("body,param", COMPLETION_ERRORS, ids=[json.dumps(b)[:50] for b, _ in COMPLETION_ERRORS])
def test_completion_errors(http, body, param):
    assert_envelope(http.post("/v1/completions", json=body), 400, param)


CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages"),  # the template cannot render it
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": OK_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": OK_CHAT, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": OK_CHAT, "max_tokens": 5000}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("body,param", CHAT_ERRORS, ids=[json.dumps(b)[:50] for b, _ in CHAT_ERRORS])
def test_chat_errors(http, body, param):
    assert_envelope(http.post("/v1/chat/completions", json=body), 400, param)


def test_context_length_error_names_both_numbers(http):
    error = assert_envelope(http.post("/v1/completions", json={"prompt": TOO_LONG, "max_tokens": 200}), 400)
    assert "4096" in error["message"] and "4200" in error["message"] and "4000" in error["message"]


def test_body_errors(http):
    assert_envelope(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                    400, contains="JSON")
    assert_envelope(http.post("/v1/completions", json=[1, 2]), 400)
    assert_envelope(http.post("/tokenize", json={}), 400)
    assert_envelope(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")


def test_unknown_model_route_and_method(http):
    assert_envelope(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model",
                    "model_not_found")
    assert_envelope(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": OK_CHAT}), 404,
                    code="model_not_found")
    assert http.post("/v1/completions", json={"model": "", "prompt": "x", "max_tokens": 1}).status_code == 200
    assert_envelope(http.get("/v1/nothing-here"), 404, contains="/v1/nothing-here")
    assert_envelope(http.get("/v1/completions"), 405)


def test_server_keeps_serving_after_errors(http, served):
    for body, _ in COMPLETION_ERRORS[:8]:
        http.post("/v1/completions", json=body)
    r = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 3, "unknown": [1, 2]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert http.get("/health").status_code == 200
    engine = served[1]
    assert engine.stats().running == 0 and engine.stats().waiting == 0  # no request leaked in the engine


def test_request_id_echoed_and_engine_ids_unique(http, served):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1" and r.json()["id"] == "cmpl-my-id-1"
    generated = http.get("/v1/models").headers["x-request-id"]
    assert len(generated) == 32
    assert http.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "bad-1"}) \
        .headers["x-request-id"] == "bad-1"  # errors carry it too
    url = served[0].url

    def reused(_):
        body = {"prompt": "same id", "max_tokens": 20, "n": 2, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": "dup"}) as resp:
            return resp.status_code, resp.read()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(reused, range(4)))
    assert all(status == 200 and b"[DONE]" in body and b'"error"' not in body for status, body in results)
    ids = [rid for rid in served[1].received if rid.startswith("dup-")]
    assert len(ids) == len(set(ids)) == 8


def test_api_key_and_open_endpoints(tokenizer):
    with serve_fake(tokenizer, model_name=MODEL, api_key="sekret") as (server, _):
        url = server.url
        body = {"prompt": "x", "max_tokens": 1}
        assert_envelope(httpx.post(url + "/v1/completions", json=body), 401, code="invalid_api_key")
        assert_envelope(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                        401, code="invalid_api_key")
        assert_envelope(httpx.get(url + "/v1/models"), 401)
        assert_envelope(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_cors(tokenizer):
    with serve_fake(tokenizer, allowed_origins=("https://app.example",), api_key="k") as (server, _):
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(server.url + "/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers
        evil = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        simple = httpx.get(server.url + "/health", headers={"Origin": "https://app.example"})
        assert simple.headers["access-control-allow-origin"] == "https://app.example"


def test_no_tokenizer_and_no_chat_template(tokenizer):
    with serve_fake(None, vocab_size=1024) as (server, _):
        url = server.url
        assert_envelope(httpx.post(url + "/v1/completions", json={"prompt": "text"}), 400, "prompt")
        assert_envelope(httpx.post(url + "/v1/chat/completions", json={"messages": OK_CHAT}), 400)
        assert_envelope(httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "stop": ["x"]}), 400)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "logprobs": 1}).json()
        assert len(r["choices"][0]["token_ids"]) == 3 and r["choices"][0]["text"] == ""
        assert r["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    bare = Tokenizer(default_model_dir())
    bare.chat_template = None
    with serve_fake(bare) as (server, _):
        error = assert_envelope(httpx.post(server.url + "/v1/chat/completions", json={"messages": OK_CHAT}), 400)
        assert "chat template" in error["message"]
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
