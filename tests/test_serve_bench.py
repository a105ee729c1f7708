"""benchmarks/serve.py and plot_serve.py: metric definitions, arrivals, SSE parsing, datasets, a run
against a fake server (failure injection, exact accounting of what was sent), and runs against the
real ``serve`` on the tiny model on both endpoints, whose results are then plotted.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_harness import start_server, stop_server

from benchmarks.serve import SSEParser, arrival_offsets, main, parse_args, parse_event
from benchmarks.serve_datasets import LocalTokenizer, length_bounds, load_sharegpt, sample_random
from benchmarks.serve_metrics import RequestRecord, compute_metrics

SHAREGPT_TINY = Path(__file__).parent / "data" / "sharegpt_tiny.json"


# ----------------------------------------------------------------------------- metrics
def _rec(i, chunks, usage=None, chunk_tokens=None, ok=True, max_tokens=None, send=0.0):
    r = RequestRecord(index=i, prompt_len=10 * (i + 1), max_tokens=max_tokens or 0, scheduled=0.0, send=send)
    r.chunk_times = [send + c for c in chunks]
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
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0) and m["p99_ttft_ms"] == pytest.approx(298.0)
    # ITL pooled [.1 .2 .3]
    assert m["mean_itl_ms"] == pytest.approx(200.0) and m["p90_itl_ms"] == pytest.approx(280.0)
    # TPOT [.15 .1] (single-token request excluded): p90 at rank .9 of [.1 .15] -> .145
    assert m["mean_tpot_ms"] == pytest.approx(125.0) and m["p90_tpot_ms"] == pytest.approx(145.0)
    # E2E [.4 .6 .2]: p99 at rank 1.98 of [.2 .4 .6] -> .596
    assert m["mean_e2el_ms"] == pytest.approx(400.0) and m["p99_e2el_ms"] == pytest.approx(596.0)
    assert m["std_e2el_ms"] == pytest.approx(np.std([400.0, 600.0, 200.0]))
    # vLLM's per-request lists: failed requests hold zeros, [] and their error.
    assert m["output_lens"] == [3, 4, 1, 0] and m["input_lens"] == [10, 20, 30, 40]
    assert m["ttfts"] == pytest.approx([0.1, 0.3, 0.2, 0.0]) and m["latencies"] == pytest.approx([0.4, 0.6, 0.2, 0.0])
    assert m["itls"][0] == pytest.approx([0.1, 0.2]) and m["itls"][2:] == [[], []]
    assert m["errors"] == ["", "", "", "HTTP 500: boom"]
    assert m["output_len_mismatch"] == 0 and m["usage_missing"] == 0 and m["request_goodput"] is None


def test_metrics_usage_fallback_and_empty():
    # No usage event: tokens reported per chunk (2, then unknown = 1) -> 3 output tokens.
    r = _rec(0, [0.1, 0.3], usage=None, chunk_tokens=[2, None], max_tokens=3)
    assert r.usage_missing and r.output_tokens == 3 and r.tpot == pytest.approx(0.1)
    m = compute_metrics([r], duration=1.0, percentiles=[50])
    assert m["usage_missing"] == 1 and m["output_len_mismatch"] == 0
    # Everything failed: statistics are None, not a misleading 0.
    m = compute_metrics([_rec(0, [], ok=False)], duration=1.0, percentiles=[99], metrics=("ttft",))
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["p99_ttft_ms"] is None
    assert "mean_tpot_ms" not in m  # only the selected --percentile-metrics


def test_peaks_and_goodput():
    usage = {"prompt_tokens": 1, "completion_tokens": 3}
    records = [_rec(0, [0.2, 0.5, 1.5], usage, send=0.0, max_tokens=3),  # in flight [0, 1.5)
               _rec(1, [0.1, 0.2, 0.3], usage, send=1.0, max_tokens=3),  # [1.0, 1.3): overlaps 0
               _rec(2, [0.1, 0.2, 1.0], usage, send=1.5, max_tokens=3)]  # starts as 0 ends: not overlapping
    m = compute_metrics(records, duration=3.0, percentiles=[99], goodput={"ttft": 150, "tpot": 400})
    assert m["max_concurrent_requests"] == 2
    # Tokens per 1-second bin: [0,1): 2 (req 0), [1,2): 1 + 3 + 2 = 6, [2,3): 1.
    assert m["max_output_tokens_per_s"] == 6
    # Good: TTFT <= 150 ms and TPOT <= 400 ms. Request 0: TTFT 200 (no); 1: 100, 100 (yes); 2: 100, 450 (no).
    assert m["request_goodput"] == pytest.approx(1 / 3.0)


# ----------------------------------------------------------------------------- arrivals
def test_arrival_schedule():
    n, rate = 4000, 4.0
    a = arrival_offsets(np.random.default_rng(7), n, rate)
    assert np.array_equal(a, arrival_offsets(np.random.default_rng(7), n, rate))  # seeded
    assert not np.array_equal(a, arrival_offsets(np.random.default_rng(8), n, rate))
    assert np.all(np.diff(a) > 0) and a[0] > 0
    assert a[-1] == pytest.approx(n / rate)  # rescaled like vLLM: mean rate exactly `rate`
    gaps = np.diff(np.concatenate([[0.0], a]))
    assert gaps.mean() == pytest.approx(1 / rate)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)  # Poisson: exponential gaps, CV 1
    # Gamma gaps of shape k have CV 1/sqrt(k): burstier below 1, more regular above.
    for k in (0.25, 4.0):
        g = np.diff(np.concatenate([[0.0], arrival_offsets(np.random.default_rng(7), n, rate, k)]))
        assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(k), rel=0.08)
    assert np.all(arrival_offsets(np.random.default_rng(0), 5, math.inf) == 0)


# ----------------------------------------------------------------------------- SSE
def test_sse_parsing_completions():
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
    assert "".join(e.text for e in events[:3]) == "Hello"
    assert events[3].usage["completion_tokens"] == 5
    # Multi-line data is joined; an event without its closing blank line comes out of flush().
    p = SSEParser()
    assert p.feed('data: {"choices":') is None and p.feed('data: [{"text":"x"}]}') is None
    assert json.loads(p.flush()) == {"choices": [{"text": "x"}]} and p.flush() is None
    assert parse_event('{"error":{"message":"overloaded"}}').error == "overloaded"
    assert parse_event('{"choices":[{"text":"","token_ids":[]}]}').kind == "other"


def test_sse_parsing_chat():
    def chunk(delta, finish=None, **extra):
        return json.dumps({"object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]})

    # The opening role chunk is sent before any token by OpenAI-style servers: not a token.
    assert parse_event(chunk({"role": "assistant", "content": ""})).kind == "other"
    assert parse_event(chunk({"role": "assistant"})).kind == "other"
    # vLLM sends the role with the first token's text: a token.
    first = parse_event(chunk({"role": "assistant", "content": "Hi"}))
    assert (first.kind, first.text) == ("token", "Hi")
    assert parse_event(chunk({"content": ""})).kind == "token"  # e.g. a special token (vLLM's rule)
    assert parse_event(chunk({}, finish="stop")).kind == "token"
    assert parse_event(chunk({"tool_calls": [{"index": 0}]})).kind == "token"
    lp = parse_event(chunk({"content": "ab"}, logprobs={"content": [{"token": "a"}, {"token": "b"}]}))
    assert (lp.kind, lp.n_tokens) == ("token", 2)


# ----------------------------------------------------------------------------- datasets
def test_random_lengths():
    # vLLM's bounds: floor(L(1-r)), ceil(L(1+r)), at least 1.
    assert length_bounds(128, 0.0) == (128, 128)
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(3, 0.9) == (1, 6)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="range-ratio"):
            length_bounds(10, bad)
    reqs = sample_random(np.random.default_rng(0), 400, 20, 8, 0.5, (100, 110))
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert (min(in_lens), max(in_lens)) == (10, 30) and (min(out_lens), max(out_lens)) == (4, 12)
    assert all(len(r.prompt) == r.prompt_len and all(100 <= t < 110 for t in r.prompt) for r in reqs)
    again = sample_random(np.random.default_rng(0), 400, 20, 8, 0.5, (100, 110))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint):
    return LocalTokenizer(tiny_checkpoint)


def test_sharegpt(tiny_tokenizer, tmp_path):
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    # tests/data/sharegpt_tiny.json: 4 usable conversations; one prompt of 3 tokens, one single turn
    # and one 3-token answer are filtered out as vLLM does.
    samples = load_sharegpt(SHAREGPT_TINY, 10, tiny_tokenizer, rng(), oversample=False)
    usable = {e["conversations"][0]["value"] for e in json.loads(SHAREGPT_TINY.read_text())[:4]}
    assert len(samples) == 4 and {s.prompt for s in samples} == usable
    for s in samples:
        assert s.prompt_len == len(tiny_tokenizer.encode(s.prompt)) >= 4 and s.expected_output_len >= 4
    assert [s.prompt for s in load_sharegpt(SHAREGPT_TINY, 10, tiny_tokenizer, rng(), oversample=False)] == \
        [s.prompt for s in samples]  # seeded shuffle
    assert [s.prompt for s in load_sharegpt(SHAREGPT_TINY, 2, tiny_tokenizer, rng(), shuffle=False)] == \
        [e["conversations"][0]["value"] for e in json.loads(SHAREGPT_TINY.read_text())[:2]]
    # An output length given on the command line also admits the 3-token answer.
    fixed = load_sharegpt(SHAREGPT_TINY, 10, tiny_tokenizer, rng(), output_len=7, oversample=False)
    assert len(fixed) == 5 and {s.expected_output_len for s in fixed} == {7}
    # Oversampling repeats usable prompts up to --num-prompts.
    over = load_sharegpt(SHAREGPT_TINY, 9, tiny_tokenizer, rng())
    assert len(over) == 9 and {s.prompt for s in over} == usable
    # Too long: prompts over 1024 tokens, or prompt + output over 2048.
    long = tmp_path / "long.json"
    long.write_text(json.dumps([{"conversations": [{"value": "word " * 1100}, {"value": "fine answer here"}]},
                                {"conversations": [{"value": "word " * 900}, {"value": "word " * 1200}]}]))
    with pytest.raises(ValueError, match="no usable conversation"):
        load_sharegpt(long, 1, tiny_tokenizer, rng())
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(bad, 1, tiny_tokenizer, rng())


def test_cli_flags():
    args = parse_args(["--endpoint", "/v1/chat/completions", "--input-len", "5", "--output-len", "3"])
    assert (args.backend, args.api, args.random_input_len, args.random_output_len) == ("openai-chat", "chat", 5, 3)
    assert args.ignore_eos and args.base_url == "http://127.0.0.1:8000"
    args = parse_args(["--backend", "openai-chat", "--host", "h", "--port", "1"])
    assert args.endpoint == "/v1/chat/completions" and args.base_url == "http://h:1"
    args = parse_args(["--result-json", "x.json", "--request-rate", "1", "inf", "--max-concurrency", "2", "4",
                       "--goodput", "ttft:100", "tpot:20"])
    assert args.save_result and args.save_detailed and args.result_filename == "x.json"
    assert args.request_rate == [1.0, math.inf] and args.max_concurrency == [2, 4]
    assert args.goodput_slo == {"ttft": 100.0, "tpot": 20.0}
    for bad in (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
                ["--dataset-name", "sharegpt"], ["--dataset-path", "x.json"],
                ["--random-range-ratio", "0.5", "--percentile-metrics", "ttft,bogus"],
                ["--goodput", "latency:5"], ["--request-rate", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ----------------------------------------------------------------------------- fake server
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

    def _json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "fake-v41", "object": "model"}]})

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
                self._json(500, {"error": {"message": "boom"}})
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
                chunk = {"object": "text_completion",
                         "choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}]}
                self._chunk(f"data: {json.dumps(chunk)}\n\n")
            n_in = len(body["prompt"])
            usage = {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n}
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


def test_fake_server_run(fake_server, tmp_path, capsys):
    url, state = fake_server
    out = tmp_path / "r.json"
    [result] = main(["--base-url", url, "--api-key", "sk-test", "--num-prompts", "6", "--random-input-len", "5",
                     "--random-output-len", "3", "--random-range-ratio", "0.5", "--token-id-range", "100", "110",
                     "--max-concurrency", "2", "--num-warmups", "2", "--seed", "3", "--metric-percentiles", "50,90,99",
                     "--label", "fake", "--metadata", "note=ci", "--result-json", str(out)])
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "P99 TTFT (ms):" in table and "fake" in table

    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["label"] == "fake" and saved["note"] == "ci" and saved["model_id"] == "fake-v41"
    assert saved["max_concurrency"] == 2 and saved["request_rate"] == "inf" and saved["backend"] == "openai"
    assert not any("sk-test" in json.dumps(v) for v in saved.values())  # never write secrets to disk
    assert (saved["completed"], saved["failed"], len(saved["ttfts"])) == (6, 0, 6)
    assert saved["total_output_tokens"] == sum(saved["output_lens"]) and saved["output_len_mismatch"] == 0
    assert saved["p50_ttft_ms"] == pytest.approx(saved["median_ttft_ms"]) and saved["max_concurrent_requests"] <= 2
    for n_out, itls, ttft, lat in zip(saved["output_lens"], saved["itls"], saved["ttfts"], saved["latencies"]):
        assert 1 <= n_out <= 5 and len(itls) == math.ceil(n_out / 2) - 1  # 2 tokens per chunk
        assert lat == pytest.approx(ttft + sum(itls), abs=1e-6) and ttft > 0
    # What the server received: 2 warm-up + 6 measured streaming requests, never more than 2 at once.
    assert len(state["seen"]) == 8 and state["max_inflight"] <= 2
    for path, auth, body in state["seen"]:
        assert path == "/v1/completions" and auth == "Bearer sk-test"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "fake-v41"
        assert 2 <= len(body["prompt"]) <= 8 and all(100 <= t < 110 for t in body["prompt"])
    measured = [b["prompt"] for _, _, b in state["seen"][2:]]
    assert sorted(len(p) for p in measured) == sorted(saved["input_lens"])
    # The warm-up draws its prompts from its own random stream, and a sweep reuses the prompts:
    # every run of a sweep without warm-up sends the same prompts as the measured run above.
    state["seen"].clear()
    results = main(["--base-url", url, "--num-prompts", "6", "--random-input-len", "5", "--random-output-len", "3",
                    "--random-range-ratio", "0.5", "--token-id-range", "100", "110", "--seed", "3",
                    "--request-rate", "200", "inf", "--max-concurrency", "1", "3", "--save-result",
                    "--result-dir", str(tmp_path / "sweep"), "--result-filename", "s.json"])
    assert [(r["max_concurrency"], r["request_rate"]) for r in results] == [
        (1, 200.0), (1, "inf"), (3, 200.0), (3, "inf")]
    for k in range(4):
        assert sorted(b["prompt"] for _, _, b in state["seen"][6 * k:6 * k + 6]) == sorted(measured)
    files = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert files == ["s-200.0qps-concurrency1.json", "s-200.0qps-concurrency3.json",
                     "s-infqps-concurrency1.json", "s-infqps-concurrency3.json"]
    summary = json.loads((tmp_path / "sweep" / files[0]).read_text())
    assert "ttfts" not in summary and summary["completed"] == 6  # per-request lists need --save-detailed
    assert "Sweep" in capsys.readouterr().out


def test_fake_server_failures_and_rate(fake_server):
    url, state = fake_server
    state["fail_every"] = 3  # requests 3 and 6 get HTTP 500
    [res] = main(["--base-url", url, "--model", "m", "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                  "--request-rate", "20", "--max-concurrency", "1", "--show-errors", "1"])
    assert (res["completed"], res["failed"]) == (4, 2)
    assert [bool(e) for e in res["errors"]] == [False, False, True, False, False, True]
    assert "HTTP 500" in res["errors"][2] and "boom" in res["errors"][2]
    assert res["output_lens"][2] == 0 and res["itls"][2] == [] and res["ttfts"][2] == 0.0
    assert state["seen"][0][2]["model"] == "m" and state["seen"][0][1] is None
    sched = [s - q for s, q in zip(res["start_times"], res["queue_times"])]
    assert sched == sorted(sched) and sched[-1] == pytest.approx(6 / 20, abs=0.05)  # Poisson, rescaled


# ----------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def real_server(tiny_checkpoint):
    process, base = start_server(tiny_checkpoint, max_num_seqs=4)
    yield base
    stop_server(process)


def _check_real_run(r: dict, n: int, *, exact_output: bool) -> None:
    assert (r["completed"], r["failed"]) == (n, 0), r["errors"]
    assert r["usage_missing"] == 0
    if exact_output:
        assert r["output_len_mismatch"] == 0
    for n_out, itls, ttft, lat, start in zip(r["output_lens"], r["itls"], r["ttfts"], r["latencies"],
                                             r["start_times"]):
        assert n_out >= 1 and 0 < ttft <= lat and start >= 0
        assert len(itls) <= n_out - 1  # chunks that decode to no text are not sent on chat
        assert lat == pytest.approx(ttft + sum(itls), abs=1e-6)
    assert r["total_output_tokens"] == sum(r["output_lens"]) and r["output_throughput"] > 0


@pytest.fixture(scope="module")
def real_runs(real_server, tiny_checkpoint, tmp_path_factory):
    """Three benchmark runs against the real server: completions (a sweep of two rates), chat on random
    prompts, chat on the ShareGPT file; their result files in ``out``."""
    out = tmp_path_factory.mktemp("runs")
    common = ["--base-url", real_server, "--num-prompts", "6", "--max-concurrency", "3", "--save-result",
              "--save-detailed", "--result-dir", str(out), "--metric-percentiles", "50,99"]
    # Completions: token-id prompts of exactly the sampled lengths, a sweep of two rates.
    comp = main([*common, "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
                 "--request-rate", "20", "inf", "--num-warmups", "1", "--label", "completions"])
    # Chat, random prompts decoded to text by the server's /detokenize: failed on every request before.
    chat = main([*common, "--endpoint", "/v1/chat/completions", "--random-input-len", "16",
                 "--random-output-len", "5", "--label", "chat"])
    # Chat on the ShareGPT file with the checkpoint's own tokenizer; answers end at EOS or length.
    share = main([*common, "--backend", "openai-chat", "--dataset-name", "sharegpt", "--dataset-path",
                  str(SHAREGPT_TINY), "--tokenizer", str(tiny_checkpoint), "--sharegpt-output-len", "6",
                  "--label", "sharegpt"])
    return {"completions": comp, "chat": chat, "sharegpt": share, "out": out}


def test_real_server_both_endpoints(real_server, real_runs):
    served = httpx.get(f"{real_server}/v1/models").json()["data"][0]["id"]
    comp = real_runs["completions"]
    for r in comp:
        _check_real_run(r, 6, exact_output=True)
        assert r["model_id"] == served and r["endpoint"] == "/v1/completions"
        assert 12 <= min(r["input_lens"]) <= max(r["input_lens"]) <= 36
        assert all(3 <= n <= 9 for n in r["output_lens"])
    assert comp[0]["input_lens"] == comp[1]["input_lens"]  # one set of prompts for the whole sweep
    [chat] = real_runs["chat"]
    _check_real_run(chat, 6, exact_output=True)
    assert chat["backend"] == "openai-chat" and chat["tokenizer_id"].endswith("/tokenize")
    assert all(n == 5 for n in chat["output_lens"]) and min(chat["input_lens"]) > 5  # template tokens counted
    [share] = real_runs["sharegpt"]
    _check_real_run(share, 6, exact_output=False)
    assert all(n <= 6 for n in share["output_lens"]) and share["ignore_eos"] is False
    assert all(isinstance(t, str) for t in share["generated_texts"])
    assert len(list(real_runs["out"].glob("*.json"))) == 4


def test_plots_of_real_runs(real_runs, tmp_path):
    pytest.importorskip("matplotlib")  # the `bench` extra
    from benchmarks.plot_serve import main as plot

    files = sorted(str(p) for p in real_runs["out"].glob("*.json"))
    pngs = [plot(["distributions", *files, "-o", str(tmp_path / "dist.png")]),
            plot(["timeline", files[0], "-o", str(tmp_path / "timeline.png")]),
            plot(["sweep", *[f for f in files if "completions" in f], "-o", str(tmp_path / "sweep.png")])]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary_only = tmp_path / "summary.json"
    summary_only.write_text(json.dumps({k: v for k, v in real_runs["completions"][0].items() if k != "ttfts"}))
    with pytest.raises(SystemExit, match="--save-detailed"):
        plot(["timeline", str(summary_only), "-o", str(tmp_path / "x.png")])
