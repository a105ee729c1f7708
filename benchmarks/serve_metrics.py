"""Metrics of ``benchmarks/serve.py`` runs, with ``vllm bench serve``'s definitions and flat result keys.

The definitions are written out in ``benchmarks/serve.py``'s docstring; this module turns the
per-request records of one run into the result dict and prints it the way vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


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
    text: list[str] = field(default_factory=list)
    usage: dict | None = None
    success: bool = False
    error: str = ""

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



# ----------------------------------------------------------------------------- metrics
def _stats(name: str, values: list[float], percentiles: list[float]) -> dict:
    """``mean_<name>_ms``, ``median_...``, ``std_...``, ``p<X>_...`` of ``values`` (seconds) in ms."""
    keys = ["mean", "median", "std"] + [f"p{p:g}" for p in percentiles]
    if not values:
        return {f"{k}_{name}_ms": None for k in keys}
    a = np.asarray(values, dtype=float) * 1000.0
    stats = [a.mean(), np.median(a), a.std()] + [np.percentile(a, p) for p in percentiles]
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, stats)}


def _peaks(ok: list[RequestRecord], t0: float) -> tuple[float, int]:
    """(most output tokens received in one 1-second bin, most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    times = np.array([t - t0 for r in ok for t in r.chunk_times])
    weights = np.array([1 if n is None else n for r in ok for n in r.chunk_tokens], dtype=float)
    per_second = np.bincount(np.floor(times).astype(int), weights=weights)
    # Half-open [send, last token): an end sorts before a start at the same instant.
    events = sorted([(r.send, 1) for r in ok] + [(r.chunk_times[-1], -1) for r in ok])
    in_flight = np.cumsum([d for _, d in events])
    return float(per_second.max()), int(in_flight.max())


def goodput_ok(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (vLLM: a one-token request has TPOT 0)."""
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2e}
    return all(values[k] * 1000.0 <= v for k, v in slo_ms.items())


def compute_metrics(records: list[RequestRecord], duration: float, percentiles: list[float],
                    metrics: tuple[str, ...] = PERCENTILE_METRICS, t0: float = 0.0,
                    goodput: dict[str, float] | None = None) -> dict:
    """vLLM's flat result (summary keys and per-request lists) for one run."""
    ok = [r for r in records if r.success]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_requests = _peaks(ok, t0)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(goodput_ok(r, goodput) for r in ok) / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.success else 0.0 for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "latencies": [r.e2e if r.success else 0.0 for r in records],
        "start_times": [r.send - t0 for r in records],
        "queue_times": [r.send - r.scheduled for r in records],
        "generated_texts": ["".join(r.text) for r in records],
        "errors": [r.error for r in records],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2e for r in ok]}
    for name in metrics:
        out.update(_stats(name, series[name], percentiles))
    # Sanity counters: ignore_eos not honoured (or stopped early), or no usage event to count from.
    out["output_len_mismatch"] = sum(r.output_tokens != r.max_tokens for r in ok)
    out["usage_missing"] = sum(r.usage_missing for r in ok)
    return out


DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                 "generated_texts", "errors")


def format_table(result: dict, errors_shown: int) -> str:
    row = "{:<40} {:<10}".format
    num = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [" Serving Benchmark Result ".center(50, "=")]
    if result.get("label"):
        lines.append(row("Label:", result["label"]))
    lines += [
        row("Endpoint:", result["endpoint"]),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Maximum request concurrency:", result["max_concurrency"] or "none"),
        row("Request rate configured (RPS):", result["request_rate"] if result["request_rate"] == "inf"
            else num(result["request_rate"])),
        row("Benchmark duration (s):", num(result["duration"])),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", num(result["request_throughput"])),
    ]
    if result["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", num(result["request_goodput"])))
    lines += [
        row("Output token throughput (tok/s):", num(result["output_throughput"])),
        row("Peak output token throughput (tok/s):", num(result["max_output_tokens_per_s"])),
        row("Peak concurrent requests:", result["max_concurrent_requests"]),
        row("Total token throughput (tok/s):", num(result["total_token_throughput"])),
    ]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for name, (title, short) in titles.items():
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        if keys:
            lines.append(title.center(50, "-"))
        for key in keys:
            stat = key.split("_")[0]
            lines.append(row(f"{stat.upper() if stat[0] == 'p' else stat.capitalize()} {short} (ms):",
                             num(result[key])))
    if result["output_len_mismatch"] or result["usage_missing"]:
        lines.append(row("Output len != max_tokens (requests):", result["output_len_mismatch"]))
        lines.append(row("No usage event (requests):", result["usage_missing"]))
    errors = [f"request {i}: {e}" for i, e in enumerate(result.get("errors") or []) if e][:max(errors_shown, 0)]
    if errors:
        lines.append(f"Errors (first {len(errors)}):")
        lines += [f"  {e}" for e in errors]
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(results: list[dict]) -> str:
    """One line per run of a sweep."""
    head = (f"{'concurrency':>11} {'rate':>6} {'req/s':>7} {'out tok/s':>9} {'med TTFT':>9} {'p99 TTFT':>9} "
            f"{'med TPOT':>9} {'p99 TPOT':>9} {'failed':>6}")
    num = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [" Sweep ".center(len(head), "="), head]
    for r in results:
        lines.append(f"{str(r['max_concurrency'] or '-'):>11} {str(r['request_rate']):>6} "
                     f"{r['request_throughput']:>7.2f} {r['output_throughput']:>9.1f} "
                     f"{num(r.get('median_ttft_ms')):>9} {num(r.get('p99_ttft_ms')):>9} "
                     f"{num(r.get('median_tpot_ms')):>9} {num(r.get('p99_tpot_ms')):>9} {r['failed']:>6}")
    return "\n".join(lines)
