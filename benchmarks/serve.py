"""Load generator for OpenAI-compatible streaming ``/v1/completions`` and ``/v1/chat/completions``.

It speaks ``vllm bench serve``'s flags and writes its flat JSON result, so runs against our server,
vLLM or SGLang can be put side by side (and plotted with ``benchmarks/plot_serve.py``):

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions \
        --dataset-name random --random-input-len 128 --random-output-len 32 --random-range-ratio 0.5 \
        --num-prompts 64 --request-rate 1 2 4 inf --max-concurrency 16 --num-warmups 4 \
        --save-result --save-detailed --result-dir /tmp/bench

Several ``--request-rate`` and ``--max-concurrency`` values make a sweep: one run per
(concurrency, rate) pair, on the same prompts, one result (and file) per run, then a summary table.
A server with prefix caching would serve repeated prompts from its cache: reset it between runs,
or run each point with its own ``--seed``. The datasets are described in ``serve_datasets.py``.

Metric definitions (vLLM's; all times from the client's clock, ``time.perf_counter``):

* send time: just before the HTTP request goes out, i.e. after the ``--max-concurrency`` slot was
  acquired (the wait for the slot is recorded separately, ``queue_times``).
* token chunk: an SSE event whose ``choices`` list is non-empty (its text may be empty, e.g. a
  special token). Not counted: the usage-only final event (``choices: []``), ``[DONE]``, and on chat
  the opening ``delta: {"role": "assistant", "content": ""}`` that OpenAI-style servers send before
  any token is generated (vLLM's server sends it with the first token, so excluding it changes
  nothing there, and it keeps TTFT honest on servers that send it at once).
* TTFT = first token chunk - send.
* ITL: one value per token chunk after the first, the gap to the previous token chunk. A chunk that
  carries several tokens still gives one ITL value, the whole gap, as vLLM does; so ITL is "time
  between stream updates" and TPOT is the per-token figure.
* E2E latency (``latencies``) = last token chunk - send.
* output tokens = ``usage.completion_tokens`` (fallback when a server sends no usage: the token
  counts the chunks report, else one per chunk, and the request is counted in ``usage_missing``).
* TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
* duration: from the start of the measured run (after warm-up) until its last request finished.
  request throughput = completed / duration; output throughput = output tokens of completed
  requests / duration; total token throughput = (input + output tokens) / duration.
* mean / median / std / p<X> (numpy's linear interpolation) over completed requests; ITL
  statistics pool every ITL value. A statistic over no value is null (vLLM writes 0).
* peak output tokens/s: the most tokens received in one 1-second bin of the run; peak concurrent
  requests: the most requests between send and last token at any instant.

Per-request lists (``--save-detailed``), index = request, failed requests hold 0 / [] and their
error: ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies`` (seconds), ``start_times``
(send time, seconds after the run's start; vLLM stores the raw clock), ``queue_times``,
``generated_texts``, ``errors``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.serve_datasets import (BenchTokenizer, LocalTokenizer, SampleRequest, ServerTokenizer, as_text,
                                       load_sharegpt, sample_random)
from benchmarks.serve_metrics import (DETAILED_KEYS, PERCENTILE_METRICS, RequestRecord, compute_metrics,
                                      format_sweep, format_table)

BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


# ----------------------------------------------------------------------------- arrivals
def arrival_offsets(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Send offsets (seconds from the start) of ``n`` requests arriving at ``rate`` per second.

    Gaps follow a gamma distribution of shape ``burstiness`` and mean 1/rate (``burstiness`` 1: a
    Poisson process; below 1 burstier, above 1 more regular). Like vLLM, the cumulative schedule is
    then rescaled so the last request is due at exactly n/rate: the raw sum of n gaps is off by
    ~1/sqrt(n), which would make throughput at a fixed rate depend on the seed. ``inf`` sends
    everything at once.
    """
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0 (rate may be inf)")
    offsets = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))
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
    text: str = ""
    usage: dict | None = None
    error: str | None = None


def _is_role_announcement(choice: dict) -> bool:
    """Chat's opening chunk: the assistant role with no content, no tool call, no finish."""
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta or choice.get("finish_reason"):
        return False
    return not any(v for k, v in delta.items() if k != "role")


def parse_event(data: str) -> Event:
    """Classify one SSE data payload of a streaming completion or chat completion."""
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
    if _is_role_announcement(choice):
        return Event("other", usage=usage)
    delta = choice.get("delta")
    text = (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    n_tokens = None
    logprobs = choice.get("logprobs")
    if isinstance(choice.get("token_ids"), list):  # vLLM with return_token_ids, SGLang variants
        n_tokens = len(choice["token_ids"])
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # completions
        n_tokens = len(logprobs["tokens"])
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # chat
        n_tokens = len(logprobs["content"])
    if n_tokens == 0:  # the server told us this chunk carries no token (e.g. a bare finish_reason)
        return Event("other", usage=usage)
    return Event("token", n_tokens=n_tokens, text=text, usage=usage)


# ----------------------------------------------------------------------------- one request
def build_payload(req: SampleRequest, api: str, model: str, args: argparse.Namespace) -> dict:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if args.ignore_eos:
        payload["ignore_eos"] = True
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        if getattr(args, name) is not None:
            payload[name] = getattr(args, name)
    payload.update(args.extra_body or {})
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, rec: RequestRecord) -> RequestRecord:
    """Stream one (chat) completion into ``rec``; never raises (failures land in ``rec.error``)."""
    parser = SSEParser()

    def handle(data: str | None, now: float) -> None:
        if data is None:
            return
        ev = parse_event(data)
        if ev.kind == "token":
            rec.chunk_times.append(now)  # arrival of the line that completed this event
            rec.chunk_tokens.append(ev.n_tokens)
            rec.text.append(ev.text)
        if ev.usage:
            rec.usage = ev.usage
        if ev.kind == "error":
            raise RuntimeError(f"error event in stream: {ev.error}")

    rec.send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
            # Read to EOF rather than stopping at [DONE]: a fully read response lets httpx reuse
            # the connection, so later requests do not pay a TCP connect inside their TTFT.
            async for line in resp.aiter_lines():
                handle(parser.feed(line), time.perf_counter())
            handle(parser.flush(), time.perf_counter())  # a last event may lack its blank line
        if not rec.chunk_times:
            raise RuntimeError("stream ended without any token chunk")
        rec.success = True
    except Exception as e:  # a failed request is a result, not a crash of the benchmark
        rec.success = False
        cause = e.__cause__ or e.__context__  # httpx errors often have an empty message
        rec.error = f"{type(e).__name__}: {str(e) or repr(cause)}"
    return rec


async def run_requests(client: httpx.AsyncClient, url: str, requests: list[SampleRequest], offsets: np.ndarray,
                       max_concurrency: int | None, make_payload, t0: float, progress=None) -> list[RequestRecord]:
    """Release request i at t0 + offsets[i]; at most ``max_concurrency`` in flight (the rest queue)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(i: int, req: SampleRequest) -> RequestRecord:
        rec = RequestRecord(index=i, prompt_len=req.prompt_len, max_tokens=req.expected_output_len,
                            scheduled=time.perf_counter())
        async with limit:
            await send_request(client, url, make_payload(req), rec)
        if progress is not None:
            progress.update(1)
        return rec

    tasks = []
    for i, (req, off) in enumerate(zip(requests, offsets)):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    return list(await asyncio.gather(*tasks))


# ----------------------------------------------------------------------------- CLI
def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default after its help, unless there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or action.default is False \
                or "default" in text:
            return text
        return text + " (default: %(default)s)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    srv = p.add_argument_group("server")
    srv.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                     help="openai/vllm: completions; openai-chat: chat completions (default: from --endpoint)")
    srv.add_argument("--base-url", default=None, help="server URL; default http://HOST:PORT")
    srv.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    srv.add_argument("--port", type=int, default=8000, help="server port, when --base-url is not given")
    srv.add_argument("--endpoint", default=None,
                     help="API path (default: /v1/chat/completions for openai-chat, else /v1/completions)")
    srv.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    srv.add_argument("--served-model-name", default=None, help="name sent in requests when it differs from --model")
    srv.add_argument("--tokenizer", default=None,
                     help="tokenizer.json file or directory, for ShareGPT and chat prompts (default: --model "
                          "if it is a directory with one, else the server's /tokenize and /detokenize)")
    srv.add_argument("--api-key", default=None, help="Bearer token; $OPENAI_API_KEY when not given")
    srv.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers of every request")
    srv.add_argument("--timeout", type=float, default=600.0, help="max seconds between two reads of one stream")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random",
                      help="random token ids, or a ShareGPT-format file")
    data.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests per run")
    data.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrival times")
    data.add_argument("--input-len", type=int, default=None, help="same as --random-input-len")
    data.add_argument("--output-len", type=int, default=None,
                      help="same as --random-output-len and --sharegpt-output-len")
    data.add_argument("--random-input-len", type=int, default=1024, help="mean prompt length, tokens")
    data.add_argument("--random-output-len", type=int, default=128, help="mean max_tokens")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1")
    data.add_argument("--token-id-range", type=int, nargs=2, default=[10, 1000], metavar=("LOW", "HIGH"),
                      help="random prompt ids uniform in [LOW, HIGH) (default: 10 1000, which fits the embedded "
                           "tiny model)")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="output length of every ShareGPT request")
    data.add_argument("--no-oversample", action="store_true",
                      help="ShareGPT: do not repeat prompts to reach --num-prompts")
    data.add_argument("--disable-shuffle", action="store_true", help="ShareGPT: take conversations in file order")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                      help="requests/s (several: a sweep); inf sends everything at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                      help="max requests in flight, others wait client-side (several: a sweep; default: no cap)")
    load.add_argument("--num-warmups", "--warmup", dest="num_warmups", type=int, default=0,
                      help="requests sent (all at once) before the measured runs, not counted")
    load.add_argument("--ignore-eos", action="store_true", help="outputs of exactly max_tokens (always on for random)")
    load.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request body")
    samp = p.add_argument_group("sampling (sent only when given; temperature defaults to greedy)")
    samp.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy, so runs are comparable (vLLM leaves it to the server)")
    for name, kind in (("top-p", float), ("top-k", int), ("min-p", float), ("frequency-penalty", float),
                       ("presence-penalty", float), ("repetition-penalty", float)):
        samp.add_argument(f"--{name}", type=kind, default=None, help=f"{name.replace('-', '_')} of every request")

    res = p.add_argument_group("results")
    res.add_argument("--label", default=None, help="name of the run (default: the backend)")
    res.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="comma-separated, of ttft,tpot,itl,e2el")
    res.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    res.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                     help="SLOs (ttft, tpot, e2el in ms) for request_goodput, e.g. ttft:500 tpot:100")
    res.add_argument("--save-result", action="store_true", help="write each run's JSON result")
    res.add_argument("--save-detailed", action="store_true", help="include the per-request lists")
    res.add_argument("--result-dir", default=None, help="directory of the result files (default: cwd)")
    res.add_argument("--result-filename", default=None,
                     help="file name (default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json); in a sweep, "
                          "-RATEqps[-concurrencyN] is added before .json")
    res.add_argument("--result-json", default=None,
                     help="shorthand for --save-result --save-detailed --result-filename PATH")
    res.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="stored as top-level keys of the result")
    res.add_argument("--show-errors", type=int, default=5, help="how many failed requests' errors to print")
    res.add_argument("--disable-tqdm", action="store_true", help="no progress bar (none either when not a TTY)")
    args = p.parse_args(argv)

    api_of_endpoint = "chat" if (args.endpoint or "").rstrip("/").endswith("chat/completions") else "completions"
    if args.backend is None:
        args.backend = "openai-chat" if api_of_endpoint == "chat" else "openai"
    args.api = BACKENDS[args.backend]
    if args.endpoint is None:
        args.endpoint = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
    elif api_of_endpoint != args.api:
        p.error(f"--backend {args.backend} speaks the {args.api} API, but --endpoint {args.endpoint} is not it")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    if args.dataset_name == "random":
        if args.dataset_path:
            p.error("--dataset-path needs --dataset-name sharegpt")
        args.ignore_eos = True  # random lengths are only meaningful if the server honours them
    elif not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path")
    if args.token_id_range[0] >= args.token_id_range[1]:
        p.error("--token-id-range needs LOW < HIGH")
    if args.num_prompts < 1 or any(c is not None and c < 1 for c in args.max_concurrency):
        p.error("--num-prompts and --max-concurrency must be >= 1")
    if any(r <= 0 for r in args.request_rate) or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    args.metrics = tuple(m for m in args.percentile_metrics.split(",") if m)
    if not set(args.metrics) <= set(PERCENTILE_METRICS):
        p.error(f"--percentile-metrics: choose from {','.join(PERCENTILE_METRICS)}")
    try:
        args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
        args.goodput_slo = {k: float(v) for k, _, v in (s.partition(":") for s in args.goodput or [])}
    except ValueError:
        p.error("--metric-percentiles takes numbers; --goodput takes METRIC:MS pairs")
    if not set(args.goodput_slo) <= {"ttft", "tpot", "e2el"}:
        p.error("--goodput: metrics are ttft, tpot and e2el")
    if args.result_json:
        args.save_result = args.save_detailed = True
        args.result_filename = args.result_json
    args.headers = _key_values(args.header, "--header")
    args.metadata_items = _key_values(args.metadata, "--metadata")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def _raise_fd_limit() -> None:
    """One socket per in-flight request: lift the soft open-file limit to the hard one (Unix)."""
    with contextlib.suppress(Exception):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def first_served_model(base_url: str, headers: dict[str, str]) -> str:
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30, trust_env=False)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"--model not given and {base_url}/v1/models gave no model ({e!r})") from e


def make_tokenizer(args: argparse.Namespace, model: str, headers: dict[str, str]) -> BenchTokenizer:
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    if args.model and (Path(args.model) / "tokenizer.json").is_file():
        return LocalTokenizer(args.model)
    return ServerTokenizer(args.base_url, model, headers)


def load_requests(args: argparse.Namespace, rng: np.random.Generator, n: int,
                  tokenizer: BenchTokenizer | None) -> list[SampleRequest]:
    if args.dataset_name == "sharegpt":
        return load_sharegpt(args.dataset_path, n, tokenizer, rng, output_len=args.sharegpt_output_len,
                             oversample=not args.no_oversample, shuffle=not args.disable_shuffle)
    requests = sample_random(rng, n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                             tuple(args.token_id_range))
    return as_text(requests, tokenizer) if args.api == "chat" else requests


def result_path(args: argparse.Namespace, result: dict, model: str, sweep: bool) -> Path:
    """vLLM's file name, or ``--result-filename``; in a sweep each run's point is part of the name."""
    point = f"{result['request_rate']}qps" + (f"-concurrency{result['max_concurrency']}"
                                                if result["max_concurrency"] is not None else "")
    if args.result_filename:
        name = Path(args.result_filename)
        if sweep:
            name = name.with_name(f"{name.stem}-{point}{name.suffix or '.json'}")
    else:
        name = Path(f"{args.label or args.backend}-{point}-{Path(model).name}-{result['date']}.json")
    return Path(args.result_dir) / name if args.result_dir else name


async def run_benchmark(args: argparse.Namespace) -> list[dict]:
    """Warm-up, then one measured run per (concurrency, rate) of the sweep; a result for each."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), **args.headers}
    model = args.model or first_served_model(args.base_url, headers)
    request_model = args.served_model_name or model
    needs_tokenizer = args.dataset_name == "sharegpt" or args.api == "chat"
    tokenizer = make_tokenizer(args, request_model, headers) if needs_tokenizer else None
    # Independent random streams: changing --num-warmups or the arrivals leaves the prompts unchanged,
    # and each run's arrival schedule restarts from its own stream, so a point of a sweep is the same
    # run as that rate alone.
    prompt_seed, warm_seed, arrival_seed = np.random.SeedSequence(args.seed).spawn(3)
    prompt_rng, warm_rng = np.random.default_rng(prompt_seed), np.random.default_rng(warm_seed)
    requests = load_requests(args, prompt_rng, args.num_prompts, tokenizer)
    url = args.base_url + args.endpoint
    _raise_fd_limit()

    def make_payload(req: SampleRequest) -> dict:
        return build_payload(req, args.api, request_model, args)

    # No pool cap (httpx defaults to 100 connections, which would silently cap concurrency; the
    # semaphore is the only limit) and no pool timeout (queued requests must not time out).
    # trust_env=False: a proxy from the environment would be measured along with the server.
    client = httpx.AsyncClient(
        headers=headers, trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(connect=30.0, read=args.timeout, write=30.0, pool=None),
    )
    results = []
    async with client:
        if args.num_warmups:
            # Own prompts from the same distribution: warming on a measured prompt would hand it a
            # prefix-cache hit.
            warm_requests = load_requests(args, warm_rng, args.num_warmups, tokenizer)
            warm = await run_requests(client, url, warm_requests, np.zeros(args.num_warmups), None, make_payload,
                                      time.perf_counter())
            bad = [r.error for r in warm if not r.success]
            print(f"warm-up: {args.num_warmups - len(bad)}/{args.num_warmups} ok", file=sys.stderr)
            if len(bad) == args.num_warmups:
                raise SystemExit(f"all warm-up requests failed, e.g. {bad[0]}")
        for concurrency in args.max_concurrency:
            for rate in args.request_rate:
                offsets = arrival_offsets(np.random.default_rng(arrival_seed), len(requests), rate, args.burstiness)
                progress = _progress_bar(args, len(requests), f"rate {rate:g}, concurrency {concurrency or '-'}")
                date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
                t0 = time.perf_counter()
                records = await run_requests(client, url, requests, offsets, concurrency, make_payload, t0, progress)
                duration = time.perf_counter() - t0
                if progress is not None:
                    progress.close()
                result = {
                    "date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
                    "model_id": model, "tokenizer_id": tokenizer.name if tokenizer else None,
                    "num_prompts": len(requests), **args.metadata_items,
                    "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
                    "max_concurrency": concurrency,
                    # ours: what the workload was
                    "base_url": args.base_url, "endpoint": args.endpoint, "dataset_name": args.dataset_name,
                    "dataset_path": args.dataset_path, "random_input_len": args.random_input_len,
                    "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
                    "seed": args.seed, "num_warmups": args.num_warmups, "ignore_eos": args.ignore_eos,
                    "temperature": args.temperature,
                    **compute_metrics(records, duration, args.percentiles, args.metrics, t0, args.goodput_slo),
                }
                results.append(result)
    return results


def _progress_bar(args: argparse.Namespace, total: int, desc: str):
    if args.disable_tqdm or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results = asyncio.run(run_benchmark(args))
    for result in results:
        print(format_table(result, args.show_errors))
        if args.save_result:
            path = result_path(args, result, result["model_id"], sweep=len(results) > 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            saved = result if args.save_detailed else {k: v for k, v in result.items() if k not in DETAILED_KEYS}
            path.write_text(json.dumps(saved))
            print(f"result: {path}")
    if len(results) > 1:
        print(format_sweep(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["completed"] for r in main()) else 1)
