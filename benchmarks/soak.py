"""Soak test: a bounded run of well-behaved, careless and hostile clients against one server.

    python -m benchmarks.soak --duration 120 --clients 16 --json /tmp/soak.json

Without ``--url`` it starts ``mini-deepinfer serve`` (the embedded tiny model on CPU unless
``--server-args`` says otherwise) on a free loopback port and stops it at the end; with ``--url``
it targets a running server (pass ``--server-pid`` to also record that server's memory).

The run has two phases of ``--duration / 2`` seconds each; these run throughout:

* ``--clients`` streaming clients, each sending well-formed ``/v1/completions`` requests one after
  the other; with probability ``--disconnect-prob`` a client drops the connection mid-stream.
  Any non-2xx answer, error event, transport error or stream without ``[DONE]`` on a
  well-formed request is counted as an error (the target is 0);
* one bad-input client: malformed JSON, wrong types, huge numbers, unknown fields, ~10 MB bodies
  (with and without Content-Length), wrong content type, out-of-vocabulary token ids. Every answer
  is counted by case and status; a 5xx or a dropped connection here is a finding, a 4xx is fine;

and in the second phase only:

* a large-prompt attacker sending a text prompt of ``--attack-mb`` MB, one request after another.

It reports the inter-token latency (p50/p99) of the well-behaved streams per phase, so the cost of
the attacker shows; the RSS over time of every server process (frontend, engine core, workers:
the server's process tree); and whether ``/metrics`` gauges (requests running and waiting, KV
blocks and state slots used, frontend-pending requests) are back to 0 once the load stops.
The script copes with servers that refuse bad input at the door (413/400) and with ones that do
not (then the numbers show it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "state_slots_used",
          "frontend_requests_pending")
PREFIX = "minideepinfer:"


# ----------------------------------------------------------------------------- process memory
def _children(pid: int) -> dict[int, int]:
    """pid -> parent pid of every descendant of ``pid`` (Linux /proc, or psutil when present)."""
    try:
        import psutil

        return {c.pid: c.ppid() for c in psutil.Process(pid).children(recursive=True)}
    except ImportError:
        pass
    except Exception:
        return {}
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = ppid
                frontier.append(child)
    return found


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        try:
            import psutil

            return psutil.Process(pid).memory_info().rss / 2**20
        except Exception:
            return None


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


def process_tree(root: int) -> dict[int, str]:
    """pid -> role of the server's processes: frontend, engine-core, worker, helper."""
    tree = _children(root)
    roles = {root: "frontend"}
    for pid, ppid in tree.items():
        if "resource_tracker" in _cmdline(pid):
            roles[pid] = "helper"
        elif ppid == root:
            roles[pid] = "engine-core"
        else:
            roles[pid] = "worker"
    return roles


@dataclass
class MemorySampler:
    root: int | None
    interval: float = 2.0
    samples: list[dict] = field(default_factory=list)  # {"t": s, "<role>:<pid>": MiB, ...}

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        if self.root is None:
            return
        while not stop.is_set():
            self.sample(t0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
        self.sample(t0)

    def sample(self, t0: float) -> None:
        row: dict = {"t": round(time.perf_counter() - t0, 1)}
        for pid, role in sorted(process_tree(self.root).items()):
            rss = _rss_mib(pid)
            if rss is not None and role != "helper":
                row[f"{role}:{pid}"] = round(rss, 1)
        self.samples.append(row)

    def summary(self) -> dict[str, dict]:
        """Per process: first, peak and last RSS (MiB)."""
        out: dict[str, dict] = {}
        for row in self.samples:
            for key, value in row.items():
                if key == "t":
                    continue
                s = out.setdefault(key, {"first": value, "peak": value, "last": value})
                s["peak"] = max(s["peak"], value)
                s["last"] = value
        return out


# ----------------------------------------------------------------------------- well-behaved streams
@dataclass
class Stats:
    sent: int = 0
    completed: int = 0
    disconnects: int = 0
    errors: Counter = field(default_factory=Counter)  # well-formed requests that failed, by reason
    error_examples: list[str] = field(default_factory=list)
    itl: dict[str, list[float]] = field(default_factory=lambda: {"baseline": [], "attack": []})
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"baseline": [], "attack": []})
    max_gap: dict[str, float] = field(default_factory=lambda: {"baseline": 0.0, "attack": 0.0})
    bad: Counter = field(default_factory=Counter)  # (case, status) of bad inputs
    attack: Counter = field(default_factory=Counter)  # status of attacker requests
    attack_latency: list[float] = field(default_factory=list)

    def error(self, reason: str, detail: str) -> None:
        self.errors[reason] += 1
        if len(self.error_examples) < 5:
            self.error_examples.append(detail[:300])


class Phase:
    """Which phase a moment belongs to (the attacker runs in the second one)."""

    def __init__(self) -> None:
        self.name = "baseline"


async def stream_client(client: httpx.AsyncClient, url: str, rng: random.Random, args: argparse.Namespace,
                        stats: Stats, phase: Phase, deadline: float) -> None:
    while time.perf_counter() < deadline:
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(8, args.prompt_len))]
        payload = {"prompt": prompt, "max_tokens": rng.randint(8, args.max_tokens), "stream": True,
                   "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 30), "ignore_eos": True,
                   "stream_options": {"include_usage": True}}
        drop_after = rng.randint(1, 6) if rng.random() < args.disconnect_prob else None
        stats.sent += 1
        sent = last = time.perf_counter()
        chunks, done = 0, False
        try:
            async with client.stream("POST", url, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    stats.error(f"HTTP {resp.status_code}", body)
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        stats.error("error event", data)
                        break
                    if not event.get("choices"):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        stats.ttft[phase.name].append(now - sent)
                    else:
                        stats.itl[phase.name].append(now - last)
                        stats.max_gap[phase.name] = max(stats.max_gap[phase.name], now - last)
                    last, chunks = now, chunks + 1
                    if drop_after is not None and chunks >= drop_after:
                        break  # leaving the block closes the connection mid-stream
            if drop_after is not None and not done:
                stats.disconnects += 1
            elif done:
                stats.completed += 1
            else:
                stats.error("stream ended without [DONE]", f"{chunks} chunks")
        except httpx.HTTPError as exc:
            stats.error(type(exc).__name__, repr(exc))
        except ValueError as exc:  # undecodable event
            stats.error("bad event", repr(exc))


# ----------------------------------------------------------------------------- hostile clients
def _bad_cases(rng: random.Random) -> list[tuple[str, dict]]:
    """(case, request kwargs) of malformed, oversized or invalid requests."""
    big = b'{"prompt": "' + b"a" * (10 << 20) + b'", "max_tokens": 1}'

    async def chunked():  # no Content-Length: the server only learns the size by reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"b" * (1 << 20)
        yield b'", "max_tokens": 1}'

    js = {"Content-Type": "application/json"}
    return [
        ("bad json", {"content": b'{"prompt": "hi", "max_tokens": ', "headers": js}),
        ("not an object", {"content": b'[1, 2, 3]', "headers": js}),
        ("empty body", {"content": b"", "headers": js}),
        ("invalid utf-8", {"content": b'{"prompt": "\xff\xfe"}', "headers": js}),
        ("deep nesting", {"content": b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "headers": js}),
        ("wrong content type", {"content": b'{"prompt": "hi"}', "headers": {"Content-Type": "text/plain"}}),
        ("prompt wrong type", {"json": {"prompt": 12345, "max_tokens": 4}}),
        ("max_tokens string", {"json": {"prompt": "hi", "max_tokens": "many"}}),
        ("huge max_tokens", {"json": {"prompt": "hi", "max_tokens": 10**30}}),
        ("huge n", {"json": {"prompt": "hi", "max_tokens": 4, "n": 10**9}}),
        ("huge logprobs", {"json": {"prompt": "hi", "max_tokens": 4, "logprobs": 10**6}}),
        ("temperature inf", {"content": b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e999}', "headers": js}),
        ("negative max_tokens", {"json": {"prompt": "hi", "max_tokens": -5}}),
        ("unknown fields", {"json": {"prompt": "hi", "max_tokens": 2, "frobnicate": True, "x" * 100: [1] * 100}}),
        ("token id out of vocab", {"json": {"prompt": [1, 2, 10**12], "max_tokens": 2}}),
        ("negative token id", {"json": {"prompt": [-1, 5], "max_tokens": 2}}),
        ("huge stop list", {"json": {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1000] * 1000}}),
        ("huge logit_bias", {"json": {"prompt": "hi", "max_tokens": 2,
                                      "logit_bias": {str(i): 1.0 for i in range(200_000)}}}),
        ("many prompts", {"json": {"prompt": [[rng.randrange(10, 1000)] * 4] * 5000, "max_tokens": 2}}),
        ("10 MB body", {"content": big, "headers": js}),
        ("10 MB chunked body", {"content": chunked(), "headers": js}),
    ]


async def bad_input_client(client: httpx.AsyncClient, base: str, rng: random.Random, stats: Stats,
                           deadline: float) -> None:
    while time.perf_counter() < deadline:
        case, kwargs = rng.choice(_bad_cases(rng))
        try:
            resp = await client.post(base + "/v1/completions", **kwargs)
            status = str(resp.status_code)
        except httpx.HTTPError as exc:
            # a server that refuses an oversized body by its Content-Length answers and closes
            # while the client is still sending: the client sees the connection drop
            status = f"closed ({type(exc).__name__})"
        stats.bad[(case, status)] += 1
        await asyncio.sleep(rng.uniform(0.05, 0.3))


async def attacker(client: httpx.AsyncClient, base: str, rng: random.Random, args: argparse.Namespace,
                   stats: Stats, start: float, deadline: float) -> None:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    words = ["alpha", "beta", "gamma", "delta", "omega", "lorem", "ipsum", "token"]
    while time.perf_counter() < deadline:
        n = int(args.attack_mb * 2**20)
        text = (" ".join(rng.choice(words) for _ in range(n // 5)))[:n]
        t = time.perf_counter()
        try:
            resp = await client.post(base + "/v1/completions", json={"prompt": text, "max_tokens": 1})
            status = str(resp.status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        stats.attack[status] += 1
        stats.attack_latency.append(time.perf_counter() - t)


# ----------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "mini-deepinfer")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "deploy.cli"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", str(port), *args.server_args.split()]
    log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(base: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        while time.perf_counter() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode} during startup")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(base + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def read_gauges(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    text = (await client.get(base + "/metrics")).text
    values = {}
    for name in GAUGES:
        match = re.search(rf"^{PREFIX}{name}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M)  # with or without labels
        if match:
            values[name] = float(match.group(1))
    return values


async def wait_gauges_zero(base: str, timeout: float) -> tuple[dict[str, float], float | None]:
    """Final gauge values, and how long after the load they took to reach 0 (None: they did not)."""
    t = time.perf_counter()
    values: dict[str, float] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                values = await read_gauges(client, base)
                if values and not any(values.values()):
                    return values, time.perf_counter() - t
            if time.perf_counter() - t > timeout:
                return values, None
            await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- the run
def pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000, p)) if values else None


async def soak(args: argparse.Namespace) -> dict:
    proc, base = (None, args.url.rstrip("/")) if args.url else start_server(args)
    root = proc.pid if proc is not None else args.server_pid
    try:
        await wait_healthy(base, proc, args.startup_timeout)
        stats, phase = Stats(), Phase()
        rng = random.Random(args.seed)
        client = httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            timeout=httpx.Timeout(connect=30.0, read=args.timeout, write=60.0, pool=None))
        t0 = time.perf_counter()
        half, end = t0 + args.duration / 2, t0 + args.duration
        stop_sampling = asyncio.Event()
        sampler = MemorySampler(root)
        sampling = asyncio.create_task(sampler.run(t0, stop_sampling))

        async def switch_phase() -> None:
            await asyncio.sleep(max(0.0, half - time.perf_counter()))
            phase.name = "attack" if args.attack_mb > 0 else "baseline"

        async with client:
            url = base + "/v1/completions"
            tasks = [stream_client(client, url, random.Random(rng.random()), args, stats, phase, end)
                     for _ in range(args.clients)]
            tasks.append(switch_phase())
            if not args.no_bad_inputs:
                tasks.append(bad_input_client(client, base, random.Random(rng.random()), stats, end))
            if args.attack_mb > 0:
                tasks.append(attacker(client, base, random.Random(rng.random()), args, stats, half, end))
            await asyncio.gather(*tasks)
        load_s = time.perf_counter() - t0
        gauges, settle_s = await wait_gauges_zero(base, args.settle_timeout)
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as c:
            try:
                health = (await c.get(base + "/health")).status_code
            except httpx.HTTPError as exc:
                health = type(exc).__name__
        stop_sampling.set()
        await sampling
    finally:
        if proc is not None:
            stop_server(proc)
    bad_status = Counter()
    for (_, status), n in stats.bad.items():
        bad_status[status] += n
    return {
        "config": {k: v for k, v in vars(args).items()},
        "load_s": round(load_s, 1),
        "well_formed": {"sent": stats.sent, "completed": stats.completed, "disconnects": stats.disconnects,
                        "errors": sum(stats.errors.values()), "errors_by_reason": dict(stats.errors),
                        "error_examples": stats.error_examples},
        "latency_ms": {name: {"streams_itl_n": len(stats.itl[name]), "itl_p50": pct(stats.itl[name], 50),
                              "itl_p99": pct(stats.itl[name], 99), "itl_max": stats.max_gap[name] * 1000,
                              "ttft_p50": pct(stats.ttft[name], 50), "ttft_p99": pct(stats.ttft[name], 99)}
                       for name in ("baseline", "attack")},
        "bad_inputs": {"sent": sum(stats.bad.values()), "by_status": dict(bad_status),
                       "by_case": {f"{case} -> {status}": n for (case, status), n in sorted(stats.bad.items())}},
        "attacker": {"sent": sum(stats.attack.values()), "by_status": dict(stats.attack),
                     "latency_p50_s": float(np.median(stats.attack_latency)) if stats.attack_latency else None},
        "gauges_at_end": gauges, "gauges_zero_after_s": settle_s, "health_at_end": health,
        "rss_mib": sampler.summary(), "rss_samples": sampler.samples,
    }


def fmt(v, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def markdown(r: dict) -> str:
    c, w = r["config"], r["well_formed"]
    lines = [f"## Soak: {c['clients']} streaming clients, {r['load_s']} s, disconnect p={c['disconnect_prob']}, "
             f"attacker {c['attack_mb']} MB prompts in the 2nd half", "",
             "| well-formed requests | sent | completed | client disconnects | errors |", "|---|---|---|---|---|",
             f"| | {w['sent']} | {w['completed']} | {w['disconnects']} | **{w['errors']}** |", ""]
    if w["errors"]:
        lines += [f"errors by reason: {w['errors_by_reason']}", *[f"- `{e}`" for e in w["error_examples"]], ""]
    lines += ["| phase | ITL samples | ITL p50 ms | ITL p99 ms | max gap ms | TTFT p50 ms | TTFT p99 ms |",
              "|---|---|---|---|---|---|---|"]
    for name, m in r["latency_ms"].items():
        lines.append(f"| {name} | {m['streams_itl_n']} | {fmt(m['itl_p50'])} | {fmt(m['itl_p99'])} | "
                     f"{fmt(m['itl_max'])} | {fmt(m['ttft_p50'])} | {fmt(m['ttft_p99'])} |")
    b, a = r["bad_inputs"], r["attacker"]
    lines += ["", f"bad inputs sent: {b['sent']}, answers by status: {b['by_status']}"]
    lines += [f"- {k}: {n}" for k, n in b["by_case"].items()]
    lines += ["", f"attacker requests: {a['sent']}, by status: {a['by_status']}, "
                  f"median latency {fmt(a['latency_p50_s'], 2)} s", ""]
    g = r["gauges_at_end"]
    settled = "yes" if r["gauges_zero_after_s"] is not None else "**NO**"
    lines += [f"gauges at the end: {g} (all 0: {settled}" +
              (f", after {r['gauges_zero_after_s']:.1f} s)" if r["gauges_zero_after_s"] is not None else ")"),
              f"/health at the end: {r['health_at_end']}", ""]
    if r["rss_mib"]:
        lines += ["| process | RSS first MiB | peak MiB | last MiB |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['first']} | {v['peak']} | {v['last']} |" for k, v in r["rss_mib"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: record this process tree's RSS")
    p.add_argument("--server-args", default="--device cpu", help="extra arguments of the started server")
    p.add_argument("--server-log", default=None, help="write the started server's output here")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (two equal phases)")
    p.add_argument("--clients", type=int, default=32, help="concurrent well-behaved streaming clients")
    p.add_argument("--disconnect-prob", type=float, default=0.2, help="chance a stream is dropped mid-way")
    p.add_argument("--prompt-len", type=int, default=128, help="longest well-formed prompt (token ids)")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a well-formed request")
    p.add_argument("--attack-mb", type=float, default=3.0, help="size of the attacker's prompt; 0: no attacker")
    p.add_argument("--no-bad-inputs", action="store_true", help="leave out the bad-input client")
    p.add_argument("--timeout", type=float, default=120.0, help="max seconds between two reads")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--settle-timeout", type=float, default=30.0, help="seconds the gauges get to return to 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the full result (with RSS samples) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(Exception):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = asyncio.run(soak(args))
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = result["well_formed"]["errors"] == 0 and result["gauges_zero_after_s"] is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
