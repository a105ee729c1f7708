"""Bounded input, atomic admission, liveness and safe defaults of the HTTP frontend (fake engine).

Each test names the failure it guards against: bodies read whole before any limit, numeric
fields that overflowed into a 500, admission checked before the pending count rose (so a burst
got in far beyond the capacity), a /health blocked by tokenization, tracebacks and paths in
responses, text/plain JSON accepted, CORS and credentials open to any origin.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from frontend.fake_engine import serve_fake

COMPLETION = {"prompt": "hello", "max_tokens": 2}
LONG = {"prompt": "Tell me a long story", "max_tokens": 3000}
FAKE_ENGINE = {"per_token_s": 0.002}


def _envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


# ----------------------------------------------------------------------------- 1. bounded input
def test_body_limit_by_content_length(tokenizer):
    with serve_fake(tokenizer, max_request_bytes=1000) as (server, engine):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 1})
        assert _envelope(r, 413)["code"] == "request_too_large"
        assert engine.num_requests == 0
        assert httpx.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200


def test_body_limit_while_streaming_the_body(tokenizer):
    """A chunked body (no Content-Length) is cut off once it passes the limit: the app reads no
    more of it (it used to be read whole, then parsed)."""
    from frontend.fake_engine import fake_engine_for
    from frontend.server import build_app

    app = build_app(fake_engine_for(tokenizer), tokenizer, "m", None, [], 16, max_request_bytes=4096)
    consumed, sent = [], []

    async def receive():
        consumed.append(1)
        return {"type": "http.request", "body": b" " * 1024, "more_body": len(consumed) < 1000}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413 and b"request_too_large" in sent[1]["body"]
    assert len(consumed) == 5  # 5 KiB read, not 1000


def test_text_prompt_longer_than_context_refused_without_tokenizing(tokenizer, monkeypatch):
    with serve_fake(tokenizer, max_model_len=64) as (server, _):
        calls = []
        monkeypatch.setattr(type(tokenizer), "encode_async", lambda *a, **k: calls.append(1))
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 1000, "max_tokens": 1})
        assert "cannot fit" in _envelope(r, 400, "prompt")["message"]
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "word " * 1000}]})
        _envelope(r, 400, "messages")
        assert calls == []


BAD_NUMBERS = [
    ("top_k", 2**64), ("top_k", 2**31), ("max_tokens", 2**64), ("max_tokens", 10**30), ("n", 2**64),
    ("logprobs", 2**64), ("seed", 2**64), ("seed", -(2**64)), ("min_tokens", 2**63), ("best_of", 10**6),
    ("presence_penalty", 1e308), ("frequency_penalty", -1e308), ("repetition_penalty", 1e300),
    ("temperature", 1.7e308), ("temperature", 1e30), ("top_p", 1e300), ("min_p", -1.0),
    ("stop_token_ids", [0] * 5000), ("logit_bias", {str(i): 1 for i in range(5000)}),
]


@pytest.mark.parametrize("field,value", BAD_NUMBERS)
def test_out_of_range_numbers_are_400_naming_the_field(served, field, value):
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", json={**COMPLETION, field: value})
    error = _envelope(r, 400)
    assert field in (error["param"] or "") or field in error["message"]


@pytest.mark.parametrize("raw", [b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}',
                                 b'{"prompt": "a", "logit_bias": {"5": -Infinity}}',
                                 b'{"prompt": "a", "temperature": 1e400}',
                                 b'{"prompt": "a", "logit_bias": {"99999999999999999999999": 1}}',
                                 b'{"prompt": "a", "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
                                 b'{"prompt": [99999999999999999999999999]}',
                                 b'{"prompt": "a", "stop_token_ids": [18446744073709551616]}'])
def test_non_finite_and_huge_values_are_400(served, raw):
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    _envelope(r, 400)


def test_large_tokenization_does_not_stall_health(tokenizer):
    """/health answers quickly while a multi-megabyte prompt is being tokenized (it used to wait
    for the whole encode: seconds)."""
    with serve_fake(tokenizer) as (server, _):
        big = "hello world, this is a test. " * 35_000  # 1 MB
        done = []
        thread = threading.Thread(target=lambda: done.append(
            httpx.post(server.url + "/tokenize", json={"prompt": big}, timeout=60)))
        started = time.monotonic()
        thread.start()
        time.sleep(0.1)
        latencies = []
        while thread.is_alive() and time.monotonic() - started < 30:
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
        thread.join()
        assert done[0].status_code == 200 and done[0].json()["count"] > 50_000
        assert latencies and max(latencies) < 1.0, latencies


# ----------------------------------------------------------------------------- 2. admission
def _burst(url: str, body: dict, count: int) -> list[int]:
    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            async def one():
                return (await client.post(url + "/v1/completions", json=body)).status_code
            return await asyncio.gather(*(one() for _ in range(count)))
    return asyncio.run(run())


def test_admission_is_atomic_under_a_burst(tokenizer):
    """20 requests at once, capacity 2 running + 4 queued: exactly 6 admitted (was 4 to 20)."""
    with serve_fake(tokenizer, max_num_seqs=2, max_queued_requests=4, ttft_s=0.3) as (server, engine):
        codes = _burst(server.url, {"prompt": "burst", "max_tokens": 1}, 20)
        assert codes.count(200) == 6 and codes.count(503) == 14, codes
        assert engine.num_requests == 6
        assert server.server.config.app  # the app is still there
        # every reservation came back
        assert _burst(server.url, {"prompt": "after", "max_tokens": 1}, 6).count(200) == 6


def test_overload_503_has_retry_after(tokenizer):
    with serve_fake(tokenizer, max_num_seqs=2, max_queued_requests=0, per_token_s=0.002) as (server, _):
        with httpx.Client() as client, client.stream("POST", server.url + "/v1/completions",
                                                     json={**LONG, "stream": True, "n": 1}) as first:
            lines1 = first.iter_lines()  # (dropping the iterator would close the connection)
            next(lines1)
            with client.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as second:
                lines2 = second.iter_lines()
                next(lines2)
                r = client.post(server.url + "/v1/completions", json=COMPLETION)
                assert _envelope(r, 503)["code"] == "server_overloaded"
                assert r.headers["retry-after"] == "1"


def test_per_request_sequence_cap(tokenizer):
    with serve_fake(tokenizer, max_seqs_per_request=4) as (server, engine):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
        assert "at most 4" in _envelope(r, 400, "n")["message"]
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 1})
        _envelope(r, 400, "n")
        assert engine.num_requests == 0
        assert httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 2,
                                                                "max_tokens": 1}).status_code == 200


def test_one_request_takes_at_most_half_the_capacity(tokenizer):
    with serve_fake(tokenizer, max_num_seqs=2, max_queued_requests=6) as (server, _):  # capacity 8
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 5, "max_tokens": 1})
        assert "at most 4" in _envelope(r, 400, "n")["message"]
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 4,
                                                                "max_tokens": 1}).status_code == 200


# ----------------------------------------------------------------------------- 3. liveness
def test_health_answers_within_a_second_when_the_engine_hangs(tokenizer):
    from frontend.fake_engine import fake_engine_for

    engine = fake_engine_for(tokenizer)
    calls = []

    async def hung(timeout: float = 5.0) -> bool:
        calls.append(1)
        if len(calls) == 1:
            return True
        await asyncio.sleep(3600)

    engine.check_health = hung
    with serve_fake(tokenizer, engine=engine) as (server, _):
        assert httpx.get(server.url + "/health").status_code == 200  # first probe answered
        time.sleep(1.1)  # stale: the next call probes again, and the probe hangs
        t0 = time.monotonic()
        r = httpx.get(server.url + "/health", timeout=5)
        assert time.monotonic() - t0 < 1.0 and r.status_code == 200  # the cached answer, still young


def test_sse_keepalive_while_waiting_for_tokens(tokenizer):
    with serve_fake(tokenizer, sse_keepalive_s=0.1, ttft_s=0.5) as (server, _):
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": "slow", "max_tokens": 2, "stream": True}) as r:
            text = r.read().decode()
        assert text.startswith(": keep-alive\n\n") and text.count(": keep-alive") >= 2
        assert text.rstrip().endswith("data: [DONE]")


# ----------------------------------------------------------------------------- 6. safe defaults
def test_no_traceback_or_path_in_errors(served, monkeypatch):
    server, _ = served
    from frontend import output_stream

    def boom(*args, **kwargs):
        raise RuntimeError(f"secret detail in {os.path.abspath(__file__)}")

    monkeypatch.setattr(output_stream.OutputStream, "process", boom)
    r = httpx.post(server.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "req-boom"})
    error = _envelope(r, 500)
    assert "req-boom" in error["message"] and "secret" not in r.text and "Traceback" not in r.text
    with httpx.stream("POST", server.url + "/v1/completions", json={**COMPLETION, "stream": True},
                      headers={"X-Request-Id": "req-boom2"}) as s:
        text = s.read().decode()
    assert "req-boom2" in text and "secret" not in text and "/" + "tests" not in text


def test_models_hides_the_model_path(served):
    server, _ = served
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == card["id"] and "/" not in card["root"]


def test_post_requires_application_json(served):
    server, engine = served
    before = engine.num_requests
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = httpx.post(server.url + path, content=b'{"prompt": "x", "max_tokens": 1}',
                       headers={"content-type": "text/plain"})
        assert _envelope(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    assert engine.num_requests == before + 1


def test_cors_off_by_default_and_no_credentials_with_wildcard(tokenizer):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    with serve_fake(tokenizer) as (server, _):
        r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        assert "access-control-allow-origin" not in httpx.options(server.url + "/v1/completions",
                                                                  headers=preflight).headers
    with serve_fake(tokenizer, allowed_origins=("*",)) as (server, _):
        r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers


def test_api_key_from_environment(monkeypatch):
    import argparse

    from frontend.server import API_KEY_ENV, resolve_api_key

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(argparse.Namespace(api_key=None)) == "from-env"
    assert resolve_api_key(argparse.Namespace(api_key="flag")) == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(argparse.Namespace(api_key=None)) is None


def test_metrics_require_key(tokenizer):
    with serve_fake(tokenizer, api_key="k", metrics_require_key=True) as (server, _):
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
    with serve_fake(tokenizer, api_key="k") as (server, _):
        assert httpx.get(server.url + "/metrics").status_code == 200  # off by default
