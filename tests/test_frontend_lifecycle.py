"""Metrics, client disconnects (streaming and not), backpressure, and a dying engine."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from frontend.fake_engine import serve_fake

LONG = {"prompt": "Tell me a long story", "max_tokens": 3000}  # ~6 s of fake generation: never finishes here
METRIC_NAMES = [
    "minideepinfer:num_requests_running", "minideepinfer:num_requests_waiting", "minideepinfer:kv_blocks_used",
    "minideepinfer:kv_blocks_total", "minideepinfer:state_slots_used", "minideepinfer:state_slots_total",
    "minideepinfer:kv_cache_usage_perc", "minideepinfer:num_preemptions_total",
    "minideepinfer:iteration_tokens_total_bucket", "minideepinfer:time_to_first_token_seconds_bucket",
    "minideepinfer:inter_token_latency_seconds_bucket", "minideepinfer:e2e_request_latency_seconds_bucket",
    "minideepinfer:request_queue_time_seconds_bucket", "minideepinfer:request_success_total",
    "minideepinfer:prompt_tokens_total", "minideepinfer:generation_tokens_total",
    "minideepinfer:requests_aborted_total", "minideepinfer:requests_rejected_total",
    # the vLLM names of the same metrics (--vllm-metrics-alias, on by default)
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:request_success_total",
]


FAKE_ENGINE = {"per_token_s": 0.002, "ttft_s": 0.01}
MODEL = "fake-model"


def scrape(url: str) -> dict[str, float]:
    """``name`` (or ``name{label="value"}`` for labels other than model_name and engine) -> value,
    from the Prometheus text format; every series must carry the model_name label."""
    text = httpx.get(url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            assert labels.pop("model_name") == MODEL and labels.pop("engine") == "0", line
            extra = ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "le")
            if "le" in labels:
                continue  # histogram buckets: the tests read _count and _sum
            samples[match.group(1) + (f"{{{extra}}}" if extra else "")] = float(match.group(3))
    return samples


def wait_for(condition, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def engine_idle(url: str) -> bool:
    m = scrape(url)
    return all(m[f"minideepinfer:{name}"] == 0 for name in
               ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "state_slots_used",
                "frontend_requests_pending"))


def test_metrics_names_and_counts(served):
    server, _ = served
    body = {"prompt": "count me", "max_tokens": 5, "seed": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    m = scrape(server.url)
    assert m['minideepinfer:request_success_total{finished_reason="length"}'] >= 1
    assert m["minideepinfer:generation_tokens_total"] >= 5 and m["minideepinfer:prompt_tokens_total"] >= 3
    assert m["minideepinfer:time_to_first_token_seconds_count"] >= 1
    assert m["minideepinfer:inter_token_latency_seconds_count"] >= 4
    assert m["minideepinfer:request_queue_time_seconds_count"] >= 1
    assert m["minideepinfer:request_generation_tokens_count"] >= 1 and m["minideepinfer:request_generation_tokens_sum"] >= 5
    assert m["minideepinfer:iteration_tokens_total_count"] >= 5  # the prefill step and the 4 after it
    assert m["minideepinfer:kv_blocks_total"] > 0 and m["minideepinfer:state_slots_total"] > 0
    for name, value in m.items():  # the vLLM names carry the same values
        if name.startswith("minideepinfer:") and f"vllm:{name.split(':', 1)[1]}" in m:
            assert m[f"vllm:{name.split(':', 1)[1]}"] == value or "_created" in name, name
    assert m["vllm:time_per_output_token_seconds_count"] == m["vllm:inter_token_latency_seconds_count"]


def _running(url: str) -> bool:
    return scrape(url)["minideepinfer:num_requests_running"] >= 1


def test_streaming_disconnect_aborts(served):
    server, engine = served
    aborted = scrape(server.url)["minideepinfer:requests_aborted_total"]
    with httpx.Client() as client:
        with client.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                           headers={"X-Request-Id": "gone-streaming"}) as response:
            lines = response.iter_lines()  # (dropping this iterator would close the connection)
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)  # the blank line after each event
            assert _running(server.url) and engine.stats().kv_blocks_used > 0
        # leaving the block closes the connection mid-stream
    wait_for(lambda: engine_idle(server.url), what="the engine to drop the request")
    assert any(rid.startswith("gone-streaming-") for rid in engine.aborted_ids)
    assert scrape(server.url)["minideepinfer:requests_aborted_total"] == aborted + 1


@pytest.mark.parametrize("n", [1, 3])
def test_non_streaming_disconnect_aborts(served, n):
    server, engine = served
    request_id = f"gone-waiting-{n}"
    with httpx.Client(timeout=httpx.Timeout(5.0, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(server.url + "/v1/completions", json={**LONG, "n": n}, headers={"X-Request-Id": request_id})
    wait_for(lambda: engine_idle(server.url), what="the engine to drop the request")
    assert sum(rid.startswith(request_id + "-") for rid in engine.aborted_ids) == n


def test_chat_streaming_disconnect_aborts(served):
    server, engine = served
    body = {"messages": [{"role": "user", "content": "go on"}], "stream": True, "max_tokens": 3000}
    with httpx.Client() as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                           headers={"X-Request-Id": "gone-chat"}) as response:
            lines = response.iter_lines()
            assert '"role":"assistant"' in next(lines)
            wait_for(lambda: _running(server.url), what="generation to start")
    wait_for(lambda: engine_idle(server.url), what="the engine to drop the request")
    assert any(rid.startswith("gone-chat-") for rid in engine.aborted_ids)


def test_frontend_backpressure_503(tokenizer):
    # capacity = 1 running + 0 queued sequences: the first request fills it
    with serve_fake(tokenizer, max_queued_requests=0, max_num_seqs=1, ttft_s=0.5) as (server, _):
        first: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: first.append(
            httpx.post(server.url + "/v1/completions", json={"prompt": "first", "max_tokens": 1})))
        thread.start()
        wait_for(lambda: scrape(server.url)["minideepinfer:frontend_requests_pending"] == 1, what="the first request")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "second", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "1"
        thread.join()
        assert first[0].status_code == 200
        assert scrape(server.url)["minideepinfer:requests_rejected_total"] == 1
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "third", "max_tokens": 1}).status_code == 200


def test_engine_queue_full_503(tokenizer):
    with serve_fake(tokenizer, max_waiting=0) as (server, _):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        assert httpx.get(server.url + "/health").status_code == 200


def test_engine_death(tokenizer):
    with serve_fake(tokenizer, per_token_s=0.002) as (server, engine):
        url = server.url
        assert httpx.get(url + "/health").status_code == 200
        with httpx.Client() as client:
            with client.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                engine.kill_threadsafe("simulated crash")
                rest = "\n".join(lines)
        assert '"engine_dead"' in rest and rest.rstrip().endswith("data: [DONE]")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert "simulated crash" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.get(url + "/metrics").status_code == 200
