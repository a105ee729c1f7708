"""What a chain of dependent weight reads costs on this GPU with no arithmetic at all: the floor under
a decode step's one-token products.

    python -m benchmarks.read_chain [--instances 4] [--json PATH]

``benchmarks/kernels.py`` times a V4.1-Flash layer's nine one-token FP8 projections as the model runs
them: six launches in one CUDA graph (``wq_a`` + ``wkv``, ``wq_b`` + the indexer's ``wq_b``, ``wo_a``,
``wo_b``, ``w1`` + ``w3``, ``w2``), against the bytes they read at the measured bandwidth. Six
dependent launches cost more than their bytes whatever the kernels do: each starts only once the
previous one has finished, ramps up, and drains. This script measures that cost with a plain read:
each launch here reads the same bytes as the product it stands for (values and scales) and nothing
else. Its programs (``--programs-per-sm`` per SM) each stream a contiguous share in 16-byte loads,
pipelined ``--stages`` deep through shared memory, and store one word. Timed from CUDA-graph replays
(CUDA events, median), ``--instances`` copies of the layer in each graph with buffers of their own,
so that L2 holds none of the bytes read:

* ``alone``: each launch's shape, its instances back to back (the other launches' bytes absent);
* ``chain``: the six in the layer's order, as the products run;
* ``chain, PDL``: the same with programmatic dependent launch (each read waits for the previous
  kernel first, then lets the next one start: only the launch overlaps, as in the products);
* ``empty``: six kernels that read nothing (one program per SM): what a boundary costs alone;
* the bandwidth of the same read kernel on 4 GiB, and the copy bandwidth that ``benchmarks/kernels.py``
  divides by (``device_limits.measure_ceilings``), in the same run.

What it showed is in ``docs/benchmarks-log.md`` ("The floor of six dependent reads").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from benchmarks.device_limits import MB, Timer, log, measure_ceilings
from benchmarks.kernel_inputs import FLASH, LAYER_PAIRS, linear_specs
from model.kernels.triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel

BLOCK = 2048  # int32 words per loop step and program: 8 KB, two 16-byte loads per thread of 4 warps


@triton.jit
def _read_kernel(src, out, n_words, words_per_program, STAGES: tl.constexpr, PDL: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program p reads words ``[p * words_per_program, (p + 1) * words_per_program)`` of ``src`` and
    stores their sum at ``out[p]`` (so that no load is dead code)."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    pid = tl.program_id(0)
    begin = pid.to(tl.int64) * words_per_program
    end = tl.minimum(begin + words_per_program, n_words)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in tl.range(begin, end, BLOCK, num_stages=STAGES):
        acc += tl.load(src + start + offsets, mask=start + offsets < end, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def launch_bytes() -> list[tuple[str, int]]:
    """(name, bytes read) of each launch of the layer's one-token graph: FP8 values plus their UE8M0
    scales (one byte per 32 x 32 tile), a pair of one input in one launch."""
    specs = {spec.name: spec for spec in linear_specs(FLASH)}
    partner = dict(LAYER_PAIRS)
    launches = []
    for name, spec in specs.items():
        if name in partner.values():
            continue
        members = [spec] + ([specs[partner[name]]] if name in partner else [])
        nbytes = sum(s.groups * s.n * s.k + s.groups * s.n * s.k // 1024 for s in members)
        launches.append((" + ".join(s.name for s in members), nbytes))
    return launches


class ReadChain:
    """Reads of whole buffers by ``programs`` programs, and graphs of them timed."""

    def __init__(self, device: torch.device, programs: int, stages: int):
        self.device, self.stages, self.programs = device, stages, programs
        self.out = torch.empty(self.programs, dtype=torch.int32, device=device)

    def read(self, src: torch.Tensor, pdl: bool = False, programs: int | None = None) -> None:
        programs = programs or self.programs
        n_words = src.numel()
        per_program = max(1, triton.cdiv(triton.cdiv(n_words, programs), BLOCK)) * BLOCK
        grid = triton.cdiv(n_words, per_program) if n_words else programs  # (no words: empty programs)
        _read_kernel[(grid,)](src, self.out, n_words, per_program, STAGES=self.stages, BLOCK=BLOCK,
                              num_warps=4, **launch_arguments(pdl, self.device))

    def graph_time(self, timer: Timer, calls) -> float:
        """Median device time of one replay of a CUDA graph of ``calls`` (captured on this stream)."""
        for call in calls:  # compiled and warmed outside the capture
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            for call in calls:
                call()
        return timer.measure(lambda i: graph.replay(), 0.5, 20, 400).median_s


def read_bandwidth(timer: Timer, chain: ReadChain, device: torch.device) -> float:
    """Bytes/s of the read kernel on 4 GiB."""
    big = torch.ones(1 << 30, dtype=torch.int32, device=device)
    return big.numel() * 4 / timer.measure(lambda i: chain.read(big), 1.0, 5, 50).median_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4, help="layer copies per graph (distinct buffers)")
    ap.add_argument("--programs-per-sm", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4, help="loads in flight per program (shared-memory ring)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("read_chain needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_stream(torch.cuda.Stream(device))  # one stream for everything (workers/worker_stream.py)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    timer, chain = Timer(device), ReadChain(device, args.programs_per_sm * sms, args.stages)
    gpu = torch.cuda.get_device_name(device)

    copy_bw = measure_ceilings(device, timer, tiny=False, budget=1.0).bandwidth  # benchmarks/kernels.py's limit
    read_bw = read_bandwidth(timer, chain, device)
    log(f"{gpu}: copy {copy_bw / 1e12:.3f} TB/s (read + write), read kernel {read_bw / 1e12:.3f} TB/s (4 GiB)")

    launches = launch_bytes()
    buffers = [[torch.ones(nbytes // 4, dtype=torch.int32, device=device) for _, nbytes in launches]
               for _ in range(args.instances)]
    total = sum(nbytes for _, nbytes in launches)
    result = {"gpu": gpu, "copy_bandwidth": copy_bw, "read_bandwidth": read_bw, "instances": args.instances,
              "programs_per_sm": args.programs_per_sm, "stages": args.stages, "launches": []}
    for i, (name, nbytes) in enumerate(launches):
        alone = chain.graph_time(timer, [lambda b=layer[i]: chain.read(b) for layer in buffers]) / args.instances
        result["launches"].append({"name": name, "bytes": nbytes, "alone_s": alone, "limit_s": nbytes / copy_bw})
        log(f"  {name}: {nbytes / MB:.1f} MiB, alone {alone * 1e6:.1f} us (bytes at the copy bandwidth "
            f"{nbytes / copy_bw * 1e6:.1f} us)")
    for label, pdl in (("chain", False), ("chain, PDL", True)):
        calls = [lambda b=b, pdl=pdl: chain.read(b, pdl) for layer in buffers for b in layer]
        result[label] = chain.graph_time(timer, calls) / args.instances
    empty = torch.empty(0, dtype=torch.int32, device=device)
    result["empty"] = chain.graph_time(timer, [lambda: chain.read(empty, programs=sms)] * 6 * args.instances) \
        / args.instances
    limit = total / copy_bw
    result["bytes"], result["limit_s"] = total, limit
    log(f"layer: {total / MB:.1f} MiB, limit {limit * 1e6:.1f} us at the copy bandwidth; "
        f"sum alone {sum(x['alone_s'] for x in result['launches']) * 1e6:.1f} us; "
        f"chain {result['chain'] * 1e6:.1f} us ({limit / result['chain']:.0%} of the limit); "
        f"chain with PDL {result['chain, PDL'] * 1e6:.1f} us ({limit / result['chain, PDL']:.0%}); "
        f"six empty kernels {result['empty'] * 1e6:.1f} us; median launch alone "
        f"{statistics.median(x['alone_s'] for x in result['launches']) * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
