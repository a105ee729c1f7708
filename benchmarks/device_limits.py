"""Timing on a device and the hardware's ceilings, measured in the same run as what they judge.

* ``Timer``: per-call device times from CUDA events (host times on CPU), after warm-up, rotating
  over input sets; a short device-side sleep before each chunk of calls lets the host queue the
  whole chunk, so launch gaps stay out of the numbers.
* ``measure_ceilings``: HBM bandwidth (a large device-to-device copy, bytes read plus written), the
  bf16 tensor-core rate (a large ``torch.matmul``) and, for context, the FP8 rate
  (``torch._scaled_mm``); the limits of ``benchmarks/kernels.py`` and ``benchmarks/decode.py``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

MB = 1 << 20


# ----------------------------------------------------------------------------------- logging
STARTED = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    median_s: float
    min_s: float
    reps: int
    launch_gaps: bool = False  # the head start did not cover the host: some launch gaps are timed


class Timer:
    """Per-call device times (CUDA events) or host times (CPU), rotating over input sets."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cycles_per_s = 0.0
        if self.cuda and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 20_000_000
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            if ms > 0:
                self.cycles_per_s = cycles / (ms / 1e3)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, call, budget_s: float, min_reps: int, max_reps: int, warm: bool = True,
                syncs: bool = False) -> Timing:
        """Median time of ``call(i)`` (the i-th rotation). ``syncs``: the call waits for the device
        itself (reads a value back), so no head start can hide its host time."""
        if warm:
            call(0)
        self.sync()
        t = time.perf_counter()
        call(1)
        host_s = time.perf_counter() - t  # enqueue time (the whole call if it synchronizes)
        self.sync()
        est = time.perf_counter() - t
        reps = int(min(max(budget_s / max(est, 1e-7), min_reps), max_reps))
        samples: list[float] = []
        if est > 0.1:  # slow calls: the estimate is a fair sample, do not pay for it twice
            samples.append(est)
        i = 2
        head_start = self.cuda and self.cycles_per_s > 0 and not syncs
        max_chunk, slack, retries, gaps = 64, 1.5, 3, False
        while len(samples) < reps:
            left = reps - len(samples)
            if not self.cuda:
                for _ in range(left):
                    t = time.perf_counter()
                    call(i)
                    i += 1
                    samples.append(time.perf_counter() - t)
                break
            # The host queues a chunk of calls while the device sleeps, so that the device then
            # runs them back to back and the events time the device, not the launches. If the
            # sleep ended before the whole chunk was queued (host slower than estimated, or the
            # launch queue full), the chunk is discarded and retried smaller with a longer sleep.
            chunk = min(left, max_chunk, max(1, int(0.02 / max(host_s, 1e-6)))) if head_start else left
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(chunk)]
            if head_start:
                sleep_s = min(0.1, slack * host_s * chunk + 50e-6)
                torch.cuda._sleep(int(self.cycles_per_s * sleep_s))
                slept = torch.cuda.Event()
                slept.record()
            for start, end in events:
                start.record()
                call(i)
                end.record()
                i += 1
            behind = head_start and slept.query()
            torch.cuda.synchronize()
            if behind and retries > 0:
                retries -= 1
                max_chunk, slack = max(1, chunk // 2), slack * 2
                continue
            gaps = gaps or behind
            samples += [start.elapsed_time(end) / 1e3 for start, end in events]
        return Timing(statistics.median(samples), min(samples), len(samples), gaps)


# ----------------------------------------------------------------------------------- ceilings
@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, copy read + write
    bf16_flops: float  # FLOP/s, torch.matmul
    fp8_flops: float | None  # FLOP/s, torch._scaled_mm (context only)
    copy_bytes: int
    matmul_n: int
    l2_bytes: int


def measure_ceilings(device: torch.device, timer: Timer, tiny: bool, budget: float) -> Ceilings:
    gen = torch.Generator(device=device).manual_seed(12345)
    nbytes = (32 * MB) if tiny else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for off in range(0, nbytes, 256 * MB):
        src[off:off + 256 * MB].random_(0, 256, generator=gen)
    dst = torch.empty_like(src)
    t = timer.measure(lambda i: dst.copy_(src), budget, 5, 100)
    bandwidth = 2 * nbytes / t.median_s
    del src, dst
    log(f"bandwidth: {bandwidth / 1e12:.3f} TB/s (copy of {nbytes / (1 << 30):.2f} GiB, read + write, "
        f"median of {t.reps})")

    n = 256 if tiny else 8192
    a = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    t = timer.measure(lambda i: torch.matmul(a, b, out=c), budget, 5, 200)
    bf16_flops = 2 * n ** 3 / t.median_s
    log(f"bf16 matmul peak: {bf16_flops / 1e12:.1f} TFLOP/s ({n}^3, median of {t.reps})")

    fp8_flops = None
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        try:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device=device, dtype=torch.float32)
            t = timer.measure(lambda i: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), budget, 5, 200)
            fp8_flops = 2 * n ** 3 / t.median_s
            log(f"fp8 matmul peak (context): {fp8_flops / 1e12:.1f} TFLOP/s")
        except Exception as exc:  # not every build has it
            log(f"fp8 peak not measured: {type(exc).__name__}: {exc}")
    del a, b, c
    l2 = 1 * MB if tiny else 50 * MB
    if device.type == "cuda":
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", l2) or l2)
    return Ceilings(bandwidth, bf16_flops, fp8_flops, nbytes, n, l2)
