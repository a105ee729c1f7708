"""A decode step's small kernels at V4.1-Flash shapes, under launch settings that leave their bits unchanged.

    python benchmarks/small_kernels.py --tokens 1,16,64

At batch 1 most of a decode step's launches move a few KB: their time is the chain of dependent loads
and instructions of the few programs they start, not bandwidth. Each kernel here is timed under a few
candidate settings of its launch (pipeline depth, work per program), none of which changes its
arithmetic: every candidate's outputs must equal the module's current setting's (``torch.equal``), or
the script stops. Each time is per call, the median of CUDA-graph replays of ``--calls`` calls on
rotating inputs, next to the bytes the call moves at the copy bandwidth measured in the same run.

* mHC's coefficients (``triton_hc_coefficients``: the partial sums' pipeline depth with one block of
  tokens, ``STAGES``; then ``triton_sinkhorn``), twice per layer;
* the FP4 round trips (``triton_fp4_round_trip.BLOCK_ELEMENTS``, values per program): the indexer's
  queries ``[T, 32, 128]`` in groups of 32 with power-of-two scales, and compressed KV rows ``[T, 512]``
  in groups of 16 with E4M3 scales;
* the index queries' RoPE and FP4 round trip (``TritonKernels.rotary_fp4_round_trip``, one launch, against
  ``rotate_`` and the round trip; both on a copy of the queries, which the two launches rotate in place);
* the window's KV rows (``TritonKernels.window_kv``: RMSNorm, RoPE and the FP8 round trip in one launch,
  against the three launches it replaces, with the same bits);
* a sub-layer's input (``TritonKernels.hc_collapse_and_norm_fp8_ready``: mHC's collapse and the RMSNorm in one
  launch, against the two launches it replaces).

Prints one line per (kernel, tokens, setting) and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.device_limits import Timer, log, measure_ceilings  # noqa: E402
from benchmarks.kernels import capture_on_this_stream  # noqa: E402
from model.kernels import triton_fp4_round_trip, triton_hc_coefficients  # noqa: E402
from model.kernels.backend import KernelBackend  # noqa: E402
from model.kernels.triton_backend import TritonKernels  # noqa: E402
from model.rope import RotaryTable, rope_frequencies  # noqa: E402

HC, HIDDEN, ITERS = 4, 5120, 20  # V4.1-Flash's mHC: 4 copies of the hidden state, 20 Sinkhorn iterations
INDEX_HEADS, INDEX_DIM, KV_DIM, ROPE_DIMS = 32, 128, 512, 64


@contextlib.contextmanager
def setting(module, name: str, value) -> Iterator[None]:
    """``module.name`` set to ``value`` for the duration (a launch setting the launcher reads per call)."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def time_graph(timer: Timer, call: Callable[[int], object], calls: int, sets: int) -> float:
    """Seconds per call: ``calls`` calls (input set ``i % sets``) captured in one graph, replayed."""
    for i in range(sets):
        call(i)  # compiles outside the capture
    graph, _ = capture_on_this_stream(lambda: [call(i % sets) for i in range(calls)])
    return timer.measure(lambda i: graph.replay(), 0.3, 10, 200).median_s / calls


def with_setting(module, name: str, value, call: Callable[[int], object]) -> Callable[[int], object]:
    """``call`` run with ``module.name`` set to ``value``."""
    def run(i: int):
        with setting(module, name, value):
            return call(i)
    return run


def cases(tokens: int, device: torch.device, sets: int, gen: torch.Generator):
    """(kernel, bytes moved per call, [(setting, call(i))]) per kernel; the first setting is the current one."""
    streams = [torch.randn(tokens, HC, HIDDEN, device=device, generator=gen).bfloat16() for _ in range(sets)]
    fn = torch.randn((2 + HC) * HC, HC * HIDDEN, device=device, generator=gen) * 1e-3
    scale = torch.rand(3, device=device, generator=gen)
    base = torch.randn((2 + HC) * HC, device=device, generator=gen)

    def mhc(i):
        return triton_hc_coefficients.hc_coefficients(streams[i], fn, scale, base, HC, ITERS, 1e-6, 1e-6)

    queries = [torch.randn(tokens, INDEX_HEADS, INDEX_DIM, device=device, generator=gen).bfloat16() for _ in range(sets)]
    kv = [torch.randn(tokens, KV_DIM, device=device, generator=gen).bfloat16() for _ in range(sets)]
    norm = (torch.rand(KV_DIM, device=device, generator=gen) + 0.5).bfloat16()
    positions = [torch.randint(0, 4096, (tokens,), device=device, generator=gen) for _ in range(sets)]
    rope = RotaryTable(rope_frequencies(ROPE_DIMS, 10000.0, 1.0, 0, 32, 1), 4096, device)
    kernels = TritonKernels()

    def settings(module, name, values, call):
        current = getattr(module, name)
        ordered = [current] + [v for v in values if v != current]
        return [(f"{name} = {v}" + (" (now)" if v == current else ""), with_setting(module, name, v, call))
                for v in ordered]

    def index_queries(i):
        return triton_fp4_round_trip.fp4_round_trip(queries[i], 32)

    def compressed_kv(i):
        return triton_fp4_round_trip.fp4_round_trip(kv[i], 16, e4m3_scale=True)

    def index_queries_rotated(backend: type[KernelBackend]):  # on a copy: the two launches rotate in place
        return lambda i: backend.rotary_fp4_round_trip(kernels, queries[i].clone(), positions[i], rope, ROPE_DIMS, 32,
                                                       False)

    pres = [torch.rand(tokens, HC, device=device, generator=gen) for _ in range(sets)]
    hidden_norm = (torch.rand(HIDDEN, device=device, generator=gen) + 0.5).bfloat16()

    def sublayer_input(backend: type[KernelBackend]):
        return lambda i: backend.hc_collapse_and_norm_fp8_ready(kernels, streams[i], pres[i], hidden_norm, 1e-6)

    blocks = (512, 1024, 2048, 4096)
    return [
        ("mHC coefficients", tokens * HC * HIDDEN * 2 + fn.numel() * 4,
         settings(triton_hc_coefficients, "STAGES", (2, 3, 4, 8), mhc)),
        ("FP4 round trip, index queries", 4 * queries[0].numel(),
         settings(triton_fp4_round_trip, "BLOCK_ELEMENTS", blocks, index_queries)),
        ("FP4 round trip, compressed KV", 4 * kv[0].numel(),
         settings(triton_fp4_round_trip, "BLOCK_ELEMENTS", blocks, compressed_kv)),
        ("window KV rows (RMSNorm, RoPE, FP8 round trip)", 4 * kv[0].numel(), [
            ("one launch (now)", lambda i: kernels.window_kv(kv[i], norm, 1e-6, positions[i], rope, ROPE_DIMS)),
            ("three launches", lambda i: KernelBackend.window_kv(kernels, kv[i], norm, 1e-6, positions[i], rope,
                                                                 ROPE_DIMS))]),
        ("index queries' RoPE and FP4 round trip", 4 * queries[0].numel(), [
            ("one launch (now)", index_queries_rotated(TritonKernels)),
            ("rotate_, then the round trip", index_queries_rotated(KernelBackend))]),
        ("sub-layer input (mHC collapse, RMSNorm, FP8-ready rows)", tokens * HC * HIDDEN * 2 + 4 * tokens * HIDDEN, [
            ("one launch (now)", sublayer_input(TritonKernels)),
            ("collapse, then the norm", sublayer_input(KernelBackend))]),
    ]


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64", help="rows per call (a decode step's batch)")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("times CUDA graphs: needs a GPU")
    device = torch.device("cuda")
    torch.cuda.set_stream(torch.cuda.Stream(device))  # one stream, graphs included (benchmarks/kernels.py)
    timer = Timer(device)
    bandwidth = measure_ceilings(device, timer, tiny=False, budget=0.5).bandwidth
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, nbytes, variants in cases(tokens, device, 4, gen):
            expected = variants[0][1](0)
            for label, call in variants:
                if not same(call(0), expected):
                    raise SystemExit(f"{name}, {tokens} tokens: {label} changes the outputs")
                seconds = time_graph(timer, call, args.calls, 4)
                rows.append((name, tokens, label, seconds, nbytes / bandwidth))
                log(f"{name}, {tokens} tokens, {label}: {seconds * 1e6:.2f} us "
                    f"(bytes at the copy bandwidth: {nbytes / bandwidth * 1e6:.2f} us)")
    print(f"\n{torch.cuda.get_device_name(device)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"torch {torch.__version__}; per call, CUDA graphs of {args.calls} calls\n")
    print("| kernel | tokens | setting | µs per call | bytes at the copy bandwidth (µs) |")
    print("|---|---:|---|---:|---:|")
    for name, tokens, label, seconds, limit in rows:
        print(f"| {name} | {tokens} | {label} | {seconds * 1e6:.2f} | {limit * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
