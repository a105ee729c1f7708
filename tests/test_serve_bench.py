"""benchmarks/serve.py: metric definitions, arrival schedule, SSE parsing, and a run against a fake server.

The fake server is a ``ThreadingHTTPServer`` in a thread that streams canned completions; the real
engine is never started, so the whole file runs in a couple of seconds on CPU.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from benchmarks.serve import RequestRecord, SSEParser, arrival_offsets, compute_metrics, main, parse_event


# ----------------------------------------------------------------------------- metrics
def _rec(i, chunks, usage=None, chunk_tokens=None, ok=True, max_tokens=None):
    r = RequestRecord(index=i, prompt_len=10 * (i + 1), max_tokens=max_tokens or 0, scheduled=0.0, send=0.0)
    r.chunk_times = list(chunks)
    r.chunk_tokens = chunk_tokens or [None] * len(chunks)
    r.usage = usage
    r.success = ok
    r.error = "" if ok else "HTTP 500: boom"
    return r


def test_metrics_hand_computed():
    records = [
        # 3 tokens in 3 chunks: TTFT .1, ITL [.1, .2], E2E .4, TPOT (.4-.1)/2 = .15
        _rec(0, [0.1, 0.2, 0.4], {"prompt_tokens": 10, "completion_tokens": 3}, max_tokens=3),
        # 4 tokens in 2 chunks (the second carries 3): one ITL value .3 for the whole gap,
        # TPOT (.6-.3)/3 = .1 uses the usage token count.
        _rec(1, [0.3, 0.6], {"prompt_tokens": 20, "completion_tokens": 4}, max_tokens=4),
        # 1 token: TTFT .2, E2E .2, no TPOT, no ITL
        _rec(2, [0.2], {"prompt_tokens": 30, "completion_tokens": 1}, max_tokens=1),
        _rec(3, [], ok=False),
    ]
    m = compute_metrics(records, duration=2.0, percentiles=[90, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 8)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)
    # TTFT [.1 .3 .2] ms; numpy linear percentiles: p90 at rank 1.8 of sorted [.1 .2 .3] -> .28
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(280.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(298.0)
    # ITL pooled [.1 .2 .3]
    assert m["itl_ms"]["mean"] == pytest.approx(200.0)
    assert m["itl_ms"]["p90"] == pytest.approx(280.0)
    # TPOT [.15 .1] (single-token request excluded): p90 at rank .9 of [.1 .15] -> .145
    assert m["tpot_ms"]["mean"] == pytest.approx(125.0)
    assert m["tpot_ms"]["median"] == pytest.approx(125.0)
    assert m["tpot_ms"]["p90"] == pytest.approx(145.0)
    # E2E [.4 .6 .2]: p99 at rank 1.98 of [.2 .4 .6] -> .596
    assert m["e2el_ms"]["mean"] == pytest.approx(400.0)
    assert m["e2el_ms"]["p99"] == pytest.approx(596.0)
    assert m["e2el_ms"]["std"] == pytest.approx(np.std([400.0, 600.0, 200.0]))
    assert m["output_len_mismatch"] == 0 and m["usage_missing"] == 0


def test_metrics_usage_fallback_and_empty():
    # No usage event: tokens reported per chunk (2, then unknown = 1) -> 3 output tokens.
    r = _rec(0, [0.1, 0.3], usage=None, chunk_tokens=[2, None], max_tokens=3)
    assert r.usage_missing and r.output_tokens == 3 and r.tpot == pytest.approx(0.1)
    m = compute_metrics([r], duration=1.0, percentiles=[50])
    assert m["usage_missing"] == 1 and m["output_len_mismatch"] == 0
    # Everything failed: statistics are None, not a misleading 0.
    m = compute_metrics([_rec(0, [], ok=False)], duration=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["ttft_ms"] == {"mean": None, "median": None, "std": None, "p99": None}


# ----------------------------------------------------------------------------- arrivals
def test_poisson_schedule():
    n, rate = 4000, 4.0
    a = arrival_offsets(np.random.default_rng(7), n, rate)
    assert np.array_equal(a, arrival_offsets(np.random.default_rng(7), n, rate))  # seeded
    assert not np.array_equal(a, arrival_offsets(np.random.default_rng(8), n, rate))
    assert np.all(np.diff(a) > 0) and a[0] > 0
    assert a[-1] == pytest.approx(n / rate)  # rescaled like vLLM: mean rate exactly `rate`
    gaps = np.diff(np.concatenate([[0.0], a]))
    assert gaps.mean() == pytest.approx(1 / rate)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)  # exponential gaps: CV = 1
    assert np.all(arrival_offsets(np.random.default_rng(0), 5, math.inf) == 0)


# ----------------------------------------------------------------------------- SSE
def test_sse_parsing():
    lines = [
        ": keep-alive comment",
        "",
        'data: {"id":"c","choices":[{"index":0,"text":"Hel","token_ids":[5,6,7]}]}',
        "",
        'data: {"id":"c","choices":[{"index":0,"text":"","logprobs":{"tokens":["<s>"]}}]}\r',
        "",
        'data: {"id":"c","choices":[{"index":0,"text":"lo","finish_reason":"length"}]}',
        "",
        'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}',
        "",
        "data: [DONE]",
        "",
    ]
    p = SSEParser()
    events = [parse_event(d) for d in (p.feed(line) for line in lines) if d is not None]
    assert [e.kind for e in events] == ["token", "token", "token", "usage", "done"]
    assert [e.n_tokens for e in events[:3]] == [3, 1, None]  # several tokens, from logprobs, unknown
    assert events[3].usage["completion_tokens"] == 5
    # Multi-line data is joined; an event without its closing blank line comes out of flush().
    p = SSEParser()
    assert p.feed('data: {"choices":') is None and p.feed('data: [{"text":"x"}]}') is None
    assert json.loads(p.flush()) == {"choices": [{"text": "x"}]} and p.flush() is None
    assert parse_event('{"error":{"message":"overloaded"}}').error == "overloaded"
    assert parse_event('{"choices":[{"text":"","token_ids":[]}]}').kind == "other"


# ----------------------------------------------------------------------------- end to end
class FakeCompletions(BaseHTTPRequestHandler):
    """Streams max_tokens fake tokens, 2 per SSE chunk, then a usage-only chunk and [DONE]."""

    protocol_version = "HTTP/1.1"  # chunked + keep-alive, like uvicorn
    disable_nagle_algorithm = True  # else small SSE writes wait ~40 ms for the client's delayed ACK
    state: dict = {}

    def log_message(self, *a):  # keep pytest output clean
        pass

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        st = self.state
        with st["lock"]:
            st["seen"].append((self.path, self.headers.get("Authorization"), body))
            count = len(st["seen"])
            st["inflight"] += 1
            st["max_inflight"] = max(st["max_inflight"], st["inflight"])
        try:
            if st["fail_every"] and count % st["fail_every"] == 0:
                msg = b'{"error":{"message":"boom"}}'
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(": ping\n\n")
            n = body["max_tokens"]
            for start in range(0, n, 2):
                time.sleep(0.003)
                ids = list(range(start, min(start + 2, n)))
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}]}
                self._chunk(f"data: {json.dumps(chunk)}\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
            self._chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        finally:
            with st["lock"]:
                st["inflight"] -= 1


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the default listen backlog of 5 resets connections under bursts


@pytest.fixture
def fake_server():
    FakeCompletions.state = {"lock": threading.Lock(), "seen": [], "inflight": 0, "max_inflight": 0, "fail_every": 0}
    srv = _Server(("127.0.0.1", 0), FakeCompletions)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", FakeCompletions.state
    srv.shutdown()
    srv.server_close()


def test_end_to_end(fake_server, tmp_path, capsys):
    url, state = fake_server
    out = tmp_path / "r.json"
    result = main(["--base-url", url, "--model", "fake-v41", "--api-key", "sk-test", "--num-prompts", "6",
                   "--input-len-range", "3", "7", "--output-len-range", "1", "5", "--token-id-range", "100", "110",
                   "--max-concurrency", "2", "--warmup", "2", "--seed", "3", "--percentiles", "50,90,99",
                   "--label", "fake", "--result-json", str(out)])
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "P99 TTFT (ms):" in table and "fake" in table

    saved = json.loads(out.read_text())
    assert saved["label"] == "fake" and "api_key" not in saved["config"]
    assert saved["config"]["max_concurrency"] == 2 and saved["config"]["request_rate"] == "inf"
    m, reqs = saved["metrics"], saved["requests"]
    assert (m["completed"], m["failed"], len(reqs)) == (6, 0, 6)
    assert m["total_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert m["total_input_tokens"] == sum(r["prompt_len"] for r in reqs)
    assert m["output_len_mismatch"] == 0 and m["usage_missing"] == 0
    assert m["ttft_ms"]["p50"] == pytest.approx(m["ttft_ms"]["median"])
    for r in reqs:
        assert len(r["chunk_times_s"]) == math.ceil(r["max_tokens"] / 2)  # 2 tokens per chunk
        assert r["chunk_tokens"] == [2] * (r["max_tokens"] // 2) + [1] * (r["max_tokens"] % 2)
        assert r["ttft_s"] == pytest.approx(r["chunk_times_s"][0], abs=1e-6) and r["e2e_s"] >= r["ttft_s"] > 0
    # What the server received: 2 warm-up + 6 measured streaming requests, never more than 2 at once.
    assert len(state["seen"]) == 8 and state["max_inflight"] <= 2
    for path, auth, body in state["seen"]:
        assert path == "/v1/completions" and auth == "Bearer sk-test"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "fake-v41"
        assert 3 <= len(body["prompt"]) <= 7 and all(100 <= t < 110 for t in body["prompt"])
    # The warm-up draws its prompts from its own random stream: the measured prompts are the same
    # as in a run without warm-up.
    measured = sorted(b["prompt"] for _, _, b in state["seen"][2:])
    state["seen"].clear()
    main(["--base-url", url, "--num-prompts", "6", "--input-len-range", "3", "7", "--output-len-range", "1", "5",
          "--token-id-range", "100", "110", "--seed", "3"])
    assert sorted(b["prompt"] for _, _, b in state["seen"]) == measured
    assert result["metrics"]["completed"] == 6


def test_end_to_end_failures_and_rate(fake_server):
    url, state = fake_server
    state["fail_every"] = 3  # requests 3 and 6 get HTTP 500
    res = main(["--base-url", url, "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                "--request-rate", "20", "--max-concurrency", "1", "--show-errors", "1"])
    m = res["metrics"]
    assert (m["completed"], m["failed"]) == (4, 2)
    assert len(res["errors"]) == 1 and "HTTP 500" in res["errors"][0] and "boom" in res["errors"][0]
    assert [r["success"] for r in res["requests"]] == [True, True, False, True, True, False]
    assert "model" not in state["seen"][0][2] and state["seen"][0][1] is None
    sched = [r["scheduled_s"] for r in res["requests"]]
    assert sched == sorted(sched) and sched[-1] == pytest.approx(6 / 20, abs=0.05)  # Poisson, rescaled
