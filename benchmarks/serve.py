"""Load generator for an OpenAI-compatible streaming ``/v1/completions`` endpoint.

Works against our server or vLLM / SGLang, and reports the metrics with vLLM's
``vllm bench serve`` definitions so the numbers can be put side by side:

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --input-len-range 256 1024 --output-len 128 --request-rate 8 --max-concurrency 64 \
        --warmup 4 --label ours-tp1 --result-json /tmp/ours.json

Prompts are lists of random token ids, so no tokenizer is needed and every server sees exactly the
same input; ``ignore_eos`` makes the outputs as long as requested.

Metric definitions (all times from the client's clock, ``time.perf_counter``):

* send time: just before the HTTP request goes out, i.e. after the ``--max-concurrency`` slot was
  acquired (the wait for the slot is recorded separately as ``queue_s``).
* token chunk: an SSE event whose ``choices`` list is non-empty (vLLM's rule; its text may be empty,
  e.g. a special token). The usage-only final event (``choices: []``) and ``[DONE]`` are not.
* TTFT = first token chunk - send.
* ITL: one value per token chunk after the first, the gap to the previous token chunk. A chunk
  that carries several tokens (speculative decoding, server-side batching of the stream) still
  gives one ITL value, the whole gap, exactly as vLLM does; so ITL is "time between stream
  updates" and TPOT is the per-token figure.
* E2E latency = last token chunk - send (vLLM: the usage event and ``[DONE]`` are not counted).
* output tokens = ``usage.completion_tokens`` (fallback when a server sends no usage: the token
  counts the chunks report, else one per chunk, and the request is flagged ``usage_missing``).
* TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
* duration: from the start of the measured run (after warm-up) until the last request finished.
  request throughput = completed / duration; output token throughput = output tokens of completed
  requests / duration; total token throughput = (input + output tokens) / duration.
* mean / median / std / percentiles (numpy's linear interpolation, like vLLM) over completed
  requests; ITL statistics are over all ITL values pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


# ----------------------------------------------------------------------------- workload
def sample_lengths(rng: np.random.Generator, n: int, fixed: int, span: list[int] | None) -> list[int]:
    """``n`` lengths: ``fixed``, or uniform integers in the inclusive range ``span = [lo, hi]``."""
    if span:
        lo, hi = span
        if not 1 <= lo <= hi:
            raise ValueError(f"bad length range {span}")
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    return [fixed] * n


def make_requests(rng: np.random.Generator, n: int, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs drawn from ``rng``."""
    low, high = args.token_id_range
    in_lens = sample_lengths(rng, n, args.input_len, args.input_len_range)
    out_lens = sample_lengths(rng, n, args.output_len, args.output_len_range)
    return [([int(t) for t in rng.integers(low, high, size=li)], lo) for li, lo in zip(in_lens, out_lens)]


def arrival_offsets(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Send offsets (seconds from the start) of ``n`` requests arriving as a Poisson process.

    Gaps are exponential with mean 1/rate. Like vLLM, the cumulative schedule is then rescaled so
    the last request is due at exactly n/rate: the raw sum of n gaps is off by ~1/sqrt(n), which
    would make throughput at a fixed rate depend on the seed. ``inf`` sends everything at once.
    """
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return offsets * (n / rate) / offsets[-1]


# ----------------------------------------------------------------------------- SSE parsing
class SSEParser:
    """Server-sent events from text lines: returns each event's data once its blank line arrives.

    Comments (``:ping``) and non-data fields are skipped; several ``data:`` lines in one event are
    joined with newlines, per the SSE spec.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event, if any (also used when the stream ends without a blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass
class Event:
    kind: str  # "token" | "usage" | "done" | "error" | "other"
    n_tokens: int | None = None  # tokens in a token chunk when the server says (token_ids/logprobs)
    usage: dict | None = None
    error: str | None = None


def parse_event(data: str) -> Event:
    """Classify one SSE data payload of a streaming completion."""
    if data.strip() == "[DONE]":
        return Event("done")
    obj = json.loads(data)
    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error", obj)
        return Event("error", error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
    usage = obj.get("usage") or None  # some servers attach usage to every chunk; the last one wins
    choices = obj.get("choices") or []
    if not choices:
        return Event("usage" if usage else "other", usage=usage)
    choice = choices[0]
    n_tokens = None
    if isinstance(choice.get("token_ids"), list):  # vLLM with return_token_ids, SGLang variants
        n_tokens = len(choice["token_ids"])
    elif isinstance(choice.get("logprobs"), dict) and isinstance(choice["logprobs"].get("tokens"), list):
        n_tokens = len(choice["logprobs"]["tokens"])
    if n_tokens == 0:  # the server told us this chunk carries no token (e.g. a bare finish_reason)
        return Event("other", usage=usage)
    return Event("token", n_tokens=n_tokens, usage=usage)


# ----------------------------------------------------------------------------- one request
@dataclass
class RequestRecord:
    index: int
    prompt_len: int
    max_tokens: int
    scheduled: float = 0.0  # when the arrival schedule released it (perf_counter)
    send: float = 0.0  # when the HTTP request went out (perf_counter)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens per chunk, if reported
    end: float = 0.0  # stream closed ([DONE] or EOF)
    usage: dict | None = None
    success: bool = False
    error: str = ""
    status: int | None = None

    # Derived values, vLLM definitions (see the module docstring).
    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def usage_missing(self) -> bool:
        return not (self.usage and self.usage.get("completion_tokens") is not None)

    @property
    def output_tokens(self) -> int:
        if not self.usage_missing:
            return int(self.usage["completion_tokens"])
        return sum(1 if n is None else n for n in self.chunk_tokens)

    @property
    def input_tokens(self) -> int:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return self.prompt_len

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def to_json(self, t0: float) -> dict:
        """Times relative to the start of the run ``t0``; chunk times relative to ``send``."""
        out: dict[str, Any] = {
            "index": self.index, "success": self.success, "error": self.error or None,
            "status": self.status, "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
            "scheduled_s": self.scheduled - t0, "send_s": self.send - t0,
            "queue_s": self.send - self.scheduled, "usage": self.usage,
        }
        if self.success:
            out.update(
                input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                usage_missing=self.usage_missing, ttft_s=self.ttft, tpot_s=self.tpot, e2e_s=self.e2e,
                chunk_times_s=[round(t - self.send, 6) for t in self.chunk_times],
                chunk_tokens=self.chunk_tokens if any(n is not None for n in self.chunk_tokens) else None,
            )
        return out


def build_payload(prompt: list[int], max_tokens: int, args: argparse.Namespace) -> dict:
    payload: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
        "ignore_eos": True,  # outputs of exactly max_tokens, so runs are comparable
        "stream": True, "stream_options": {"include_usage": True},
    }
    if args.model:
        payload["model"] = args.model
    payload.update(args.extra_body or {})
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, rec: RequestRecord) -> RequestRecord:
    """Stream one completion into ``rec``; never raises (failures land in ``rec.error``)."""
    parser = SSEParser()

    def handle(data: str | None, now: float) -> None:
        if data is None:
            return
        ev = parse_event(data)
        if ev.kind == "token":
            rec.chunk_times.append(now)  # arrival of the line that completed this event
            rec.chunk_tokens.append(ev.n_tokens)
        if ev.usage:
            rec.usage = ev.usage
        if ev.kind == "error":
            raise RuntimeError(f"error event in stream: {ev.error}")

    rec.send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
            # Read to EOF rather than stopping at [DONE]: a fully read response lets httpx reuse
            # the connection, so later requests do not pay a TCP connect inside their TTFT.
            async for line in resp.aiter_lines():
                handle(parser.feed(line), time.perf_counter())
            handle(parser.flush(), time.perf_counter())  # a last event may lack its blank line
        rec.end = time.perf_counter()
        if not rec.chunk_times:
            raise RuntimeError("stream ended without any token chunk")
        rec.success = True
    except Exception as e:  # a failed request is a result, not a crash of the benchmark
        rec.end = time.perf_counter()
        rec.success = False
        cause = e.__cause__ or e.__context__  # httpx errors often have an empty message
        rec.error = f"{type(e).__name__}: {str(e) or repr(cause)}"
    return rec


async def run_requests(client: httpx.AsyncClient, url: str, requests: list[tuple[list[int], int]],
                       offsets: np.ndarray, args: argparse.Namespace, t0: float) -> list[RequestRecord]:
    """Release request i at t0 + offsets[i]; at most ``max_concurrency`` in flight (the rest queue)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

    async def one(i: int, prompt: list[int], max_tokens: int) -> RequestRecord:
        rec = RequestRecord(index=i, prompt_len=len(prompt), max_tokens=max_tokens, scheduled=time.perf_counter())
        async with limit:
            return await send_request(client, url, build_payload(prompt, max_tokens, args), rec)

    tasks = []
    for i, ((prompt, max_tokens), off) in enumerate(zip(requests, offsets)):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, prompt, max_tokens)))
    return list(await asyncio.gather(*tasks))


# ----------------------------------------------------------------------------- metrics
def summarize(values: list[float], percentiles: list[float], scale: float = 1000.0) -> dict:
    """mean/median/std/p<X> of ``values`` times ``scale`` (ms by default); None when empty."""
    keys = ["mean", "median", "std"] + [f"p{p:g}" for p in percentiles]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=float) * scale
    stats = [a.mean(), np.median(a), a.std()] + [np.percentile(a, p) for p in percentiles]
    return {k: float(v) for k, v in zip(keys, stats)}


def compute_metrics(records: list[RequestRecord], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in records if r.success]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": summarize([r.ttft for r in ok], percentiles),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None], percentiles),
        "itl_ms": summarize([g for r in ok for g in r.itl], percentiles),
        "e2el_ms": summarize([r.e2e for r in ok], percentiles),
        # Sanity counters: ignore_eos not honoured, or no usage event to count tokens from.
        "output_len_mismatch": sum(r.output_tokens != r.max_tokens for r in ok),
        "usage_missing": sum(r.usage_missing for r in ok),
        "max_queue_s": max((r.send - r.scheduled for r in records), default=0.0),
    }


def format_table(m: dict, args: argparse.Namespace, errors: list[str]) -> str:
    row = "{:<40} {:<10}".format
    num = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [" Serving Benchmark Result ".center(50, "=")]
    if args.label:
        lines.append(row("Label:", args.label))
    lines += [
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Maximum request concurrency:", args.max_concurrency or "none"),
        row("Request rate configured (RPS):", num(args.request_rate) if not math.isinf(args.request_rate) else "inf"),
        row("Benchmark duration (s):", num(m["duration_s"])),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", num(m["request_throughput"])),
        row("Output token throughput (tok/s):", num(m["output_throughput"])),
        row("Total token throughput (tok/s):", num(m["total_token_throughput"])),
    ]
    for key, title, short in [("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")]:
        lines.append(title.center(50, "-"))
        for stat, v in m[key].items():
            if stat != "std":
                lines.append(row(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {short} (ms):", num(v)))
    if m["output_len_mismatch"] or m["usage_missing"]:
        lines.append(row("Output len != max_tokens (requests):", m["output_len_mismatch"]))
        lines.append(row("No usage event (requests):", m["usage_missing"]))
    if errors:
        lines.append("Errors (first {}):".format(len(errors)))
        lines += [f"  {e}" for e in errors]
    lines.append("=" * 50)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="sent as the 'model' field when given")
    p.add_argument("--api-key", default=None, help="Bearer token; $OPENAI_API_KEY when not given")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), help="uniform in [LO, HI], overrides --input-len")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens")
    p.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), help="uniform in [LO, HI], overrides --output-len")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[10, 1000], metavar=("LOW", "HIGH"),
                   help="prompt ids uniform in [LOW, HIGH); the default fits the embedded tiny model's 1024-token vocab")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request body")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="max requests in flight (others wait client-side)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent before the measured run, not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", type=lambda s: [float(x) for x in s.split(",") if x], default=[90.0, 99.0],
                   help="comma-separated, e.g. 50,90,99")
    p.add_argument("--timeout", type=float, default=600.0, help="max seconds between two reads of one stream")
    p.add_argument("--show-errors", type=int, default=5, help="how many failed requests' errors to print")
    p.add_argument("--label", default=None, help="name of this run, stored in the result")
    p.add_argument("--result-json", default=None, help="write config, metrics and per-request records here")
    args = p.parse_args(argv)
    if args.token_id_range[0] >= args.token_id_range[1]:
        p.error("--token-id-range needs LOW < HIGH")
    return args


def _raise_fd_limit() -> None:
    """One socket per in-flight request: lift the soft open-file limit to the hard one (Unix)."""
    with contextlib.suppress(Exception):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_benchmark(args: argparse.Namespace) -> dict:
    # Independent random streams: changing --warmup or --request-rate leaves the prompts unchanged.
    prompt_rng, warm_rng, arrival_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(args.seed).spawn(3))
    requests = make_requests(prompt_rng, args.num_prompts, args)
    offsets = arrival_offsets(arrival_rng, args.num_prompts, args.request_rate)
    url = args.base_url.rstrip("/") + args.endpoint
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    _raise_fd_limit()
    # No pool cap (httpx defaults to 100 connections, which would silently cap concurrency; the
    # semaphore is the only limit) and no pool timeout (queued requests must not time out).
    # trust_env=False: a proxy from the environment would be measured along with the server.
    client = httpx.AsyncClient(
        headers=headers, trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(connect=30.0, read=args.timeout, write=30.0, pool=None),
    )
    async with client:
        if args.warmup:
            # Own prompts from the same distribution: warming on a measured prompt would hand it a
            # prefix-cache hit.
            warm = await run_requests(client, url, make_requests(warm_rng, args.warmup, args),
                                      np.zeros(args.warmup), args, time.perf_counter())
            bad = [r.error for r in warm if not r.success]
            print(f"warm-up: {args.warmup - len(bad)}/{args.warmup} ok", file=sys.stderr)
            if len(bad) == args.warmup:
                raise SystemExit(f"all warm-up requests failed, e.g. {bad[0]}")
        started_at = _dt.datetime.now(_dt.timezone.utc).isoformat()
        t0 = time.perf_counter()
        records = await run_requests(client, url, requests, offsets, args, t0)
        duration = time.perf_counter() - t0
    metrics = compute_metrics(records, duration, args.percentiles)
    errors = [f"request {r.index}: {r.error}" for r in records if not r.success]
    config = {k: v for k, v in vars(args).items() if k != "api_key"}  # never write secrets to disk
    config["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    return {"label": args.label, "started_at": started_at, "url": url, "config": config, "metrics": metrics,
            "errors": errors[: max(args.show_errors, 0)], "requests": [r.to_json(t0) for r in records]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    print(format_table(result["metrics"], args, result["errors"]))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["metrics"]["completed"] else 1)
