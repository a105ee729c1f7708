"""Frontend-only benchmark: the real HTTP server with the FakeEngineClient (no model time), driven
by N concurrent streaming clients, to measure what the frontend itself costs per request and per
token (HTTP, JSON, tokenization, incremental detokenization, SSE framing, metrics).

Run (from the repository root)::

    .venv/bin/python benchmarks/frontend_bench.py                       # concurrency 1,16,64,256
    .venv/bin/python benchmarks/frontend_bench.py --concurrency 64 --max-tokens 256 --requests 512
    .venv/bin/python benchmarks/frontend_bench.py --endpoint chat --per-token-ms 20 --json out.json

The server runs in its own process (uvicorn + uvloop, one event loop, as in production); the load
generator runs in this process on a minimal asyncio HTTP/1.1 client (keep-alive, chunked decoding,
no JSON parsing per event) so that the client is not the bottleneck. Each level reports:

* ``req/s`` and ``tok/s``: completed requests and generated tokens per second of wall time;
* ``chunks/s`` and ``tok/chunk``: SSE events; with zero model time the fake engine outruns the
  frontend and merges tokens a slow consumer has not read yet, as the real engine client may;
* ``TTFT`` and ``ITL`` percentiles (ms) as the clients saw them; with ``--per-token-ms X`` the
  frontend's added latency per token is ITL - X;
* ``server CPU/token`` (µs): CPU time of the server process (user + system, from /proc) divided
  by generated tokens: the frontend's cost per token, the fake engine's small loop included.

Client and server share the machine's cores: state the machine when quoting numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex "
         "a jovial king near the old river bank under a grey autumn sky").split()


# ----------------------------------------------------------------------------- server process
def _serve(port_pipe, stop_event, ttft_s: float, per_token_s: float, max_num_seqs: int) -> None:
    import logging

    from frontend.fake_engine import fake_engine_for
    from frontend.server import BackgroundServer, build_app
    from frontend.tokenizer import Tokenizer
    from model.checkpoint_maker import default_model_dir

    logging.basicConfig(level=logging.WARNING)
    tokenizer = Tokenizer(default_model_dir())
    engine = fake_engine_for(tokenizer, ttft_s=ttft_s, per_token_s=per_token_s, max_num_seqs=max_num_seqs,
                             max_model_len=1 << 20)
    app = build_app(engine, tokenizer, "bench", None, [], max_queued_requests=1 << 20)
    with BackgroundServer(app, log_level="warning") as server:
        port_pipe.send(server.port)
        stop_event.wait()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


# ----------------------------------------------------------------------------- client
@dataclass
class RequestResult:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0


class Connection:
    """One keep-alive HTTP/1.1 connection that posts a JSON body and reads an SSE stream."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: bytes) -> RequestResult:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        start = time.perf_counter()
        self.writer.write(head + body)
        status = await self.reader.readuntil(b"\r\n\r\n")
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"request failed: {status.decode(errors='replace')}")
        result, buffer, last = RequestResult(), b"", None
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()  # the CRLF after the last chunk
                return result
            buffer += (await self.reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                now = time.perf_counter()
                if event.startswith(b'data: {"error"'):
                    raise RuntimeError(event.decode())
                if b'"usage"' in event:
                    result.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                elif event != b"data: [DONE]" and b'"role"' not in event:
                    result.chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def request_body(endpoint: str, prompt: str, max_tokens: int, index: int) -> tuple[str, bytes]:
    common = {"max_tokens": max_tokens, "stream": True, "seed": index, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": prompt}], **common}).encode()
    return "/v1/completions", json.dumps({"prompt": prompt, **common}).encode()


async def run_level(host: str, port: int, concurrency: int, num_requests: int, args) -> dict:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    results: list[RequestResult] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        connection = Connection(host, port)
        try:
            while next_index < num_requests:
                index, next_index = next_index, next_index + 1
                path, body = request_body(args.endpoint, prompt, args.max_tokens, index)
                results.append(await connection.post_stream(path, body))
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    chunks = sum(r.chunks for r in results)
    gaps = sorted(g for r in results for g in r.gaps)
    ttfts = sorted(r.ttft for r in results)

    def pct(values: list[float], q: float) -> float:
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "req_per_s": len(results) / wall,
            "tok_per_s": tokens / wall, "chunks_per_s": chunks / wall, "tok_per_chunk": tokens / max(chunks, 1),
            "ttft_ms_p50": pct(ttfts, 0.5), "ttft_ms_p99": pct(ttfts, 0.99),
            "itl_ms_p50": pct(gaps, 0.5), "itl_ms_p90": pct(gaps, 0.9), "itl_ms_p99": pct(gaps, 0.99),
            "itl_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else float("nan"), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 4 x concurrency, >= 32)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--per-token-ms", type=float, default=0.0, help="fake model time per decode step")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="fake prefill time")
    parser.add_argument("--max-num-seqs", type=int, default=1024, help="fake engine's running batch limit")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    stop = ctx.Event()
    server = ctx.Process(target=_serve, args=(child_end, stop, args.ttft_ms / 1e3, args.per_token_ms / 1e3,
                                              args.max_num_seqs), daemon=True)
    server.start()
    if not parent_end.poll(120):
        raise SystemExit("the server did not start")
    port = parent_end.recv()
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"frontend benchmark: {args.endpoint}, {args.max_tokens} tokens/request, prompt {args.prompt_words} words, "
          f"fake model {args.ttft_ms} ms TTFT + {args.per_token_ms} ms/token, {os.cpu_count()} CPUs")
    header = (f"{'conc':>5} {'reqs':>5} {'req/s':>8} {'tok/s':>9} {'chunks/s':>9} {'tok/chunk':>9} "
              f"{'TTFT p50':>9} {'ITL p50':>8} {'ITL p90':>8} {'ITL p99':>8} {'CPU us/tok':>10}")
    print(header)
    rows = []
    try:
        asyncio.run(run_level("127.0.0.1", port, 4, 32, args))  # warm-up: imports, caches, JIT of templates
        for concurrency in levels:
            n = args.requests or max(32, 4 * concurrency)
            cpu_before = _cpu_seconds(server.pid)
            row = asyncio.run(run_level("127.0.0.1", port, concurrency, n, args))
            row["server_cpu_us_per_token"] = 1e6 * (_cpu_seconds(server.pid) - cpu_before) / max(row["tokens"], 1)
            rows.append(row)
            print(f"{concurrency:>5} {row['requests']:>5} {row['req_per_s']:>8.1f} {row['tok_per_s']:>9.0f} "
                  f"{row['chunks_per_s']:>9.0f} {row['tok_per_chunk']:>9.2f} {row['ttft_ms_p50']:>9.2f} "
                  f"{row['itl_ms_p50']:>8.3f} {row['itl_ms_p90']:>8.3f} {row['itl_ms_p99']:>8.3f} "
                  f"{row['server_cpu_us_per_token']:>10.1f}")
    finally:
        stop.set()
        server.join(10)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "levels": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
