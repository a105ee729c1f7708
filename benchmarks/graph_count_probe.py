"""Does a CUDA graph replay slower after other captures, or after work on another stream? Model-free.

    python benchmarks/graph_count_probe.py                    # side stream for captures: slow from the 4th
    python benchmarks/graph_count_probe.py --streams one      # one stream for everything: stays fast
    python benchmarks/graph_count_probe.py --streams one --warm-streams 1   # one eager launch elsewhere: slow

One graph (the *probe*) of ``--nodes`` tiny kernels (in-place adds on a 1 KiB tensor: each costs
the device little more than its launch, so the replay time is mostly the gaps between kernels) is
captured first and its replay timed (CUDA events, median of ``--replays``). Then ``--extras`` more
graphs of ``--extra-nodes`` kernels (``--extra-op``: the probe's own kernel or another) are captured
one at a time, each allocating ``--extra-bytes`` from the shared pool inside its capture, and the
probe is timed again after each; then the extras are destroyed and it is timed again; last, a new
probe of a kernel never used before is captured and timed. One JSON line per measurement.

* ``--streams side`` (what ``torch.cuda.graph`` does by default): kernels run and replay on the
  default stream, captures run on a side stream; ``one``: everything on one side stream, made
  current before the first kernel; ``fresh``: each extra capture on a new side stream.
* ``--warm-streams N``: before anything is captured, run a few kernels eagerly on N other streams.
* ``--capture torch`` captures with ``torch.cuda.graph`` (which synchronises and empties the device
  and pinned-host caching allocators before every capture); ``begin-end`` calls
  ``CUDAGraph.capture_begin``/``capture_end`` without emptying anything.
* ``--extras-instantiate``: ``torch`` (instantiated by ``capture_end``, as in the engine), ``none``
  (captured, never instantiated), or ``raw:F`` (instantiated through ``cudaGraphInstantiateWithFlags``
  with flags F, then destroyed).

What it showed on one H200 and why the engine runs on one stream: ``workers/worker_stream.py`` and
``docs/benchmarks-log.md``, "One stream".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics

import torch


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in this process's mappings)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    return ctypes.CDLL(paths.pop() if paths else "libcudart.so")


def instantiate_raw(graph: torch.cuda.CUDAGraph, flags: int) -> None:
    """Instantiate a kept graph with the runtime's own call and flags, then destroy the executable."""
    lib, executable = cudart(), ctypes.c_void_p()
    status = lib.cudaGraphInstantiateWithFlags(ctypes.byref(executable), ctypes.c_void_p(graph.raw_cuda_graph()),
                                               ctypes.c_ulonglong(flags))
    if status:
        raise RuntimeError(f"cudaGraphInstantiateWithFlags returned {status}")
    lib.cudaGraphExecDestroy(executable)


def capture(build, pool, mode: str, stream: torch.cuda.Stream, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    build()  # warm-up outside the graph, as the engine does
    torch.cuda.synchronize()
    if mode == "torch":
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            build()
    else:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            build()
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median device time of one replay (µs)."""
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=600, help="kernels in the probe graph")
    parser.add_argument("--extra-nodes", type=int, default=600, help="kernels in each extra graph")
    parser.add_argument("--extras", type=int, default=8)
    parser.add_argument("--extra-bytes", type=int, default=0, help="pool bytes each extra graph allocates")
    parser.add_argument("--capture", choices=["torch", "begin-end"], default="torch")
    parser.add_argument("--extras-instantiate", default="torch", help="torch | none | raw:FLAGS")
    parser.add_argument("--warm-streams", type=int, default=0,
                        help="before anything is captured, run the kernels eagerly on this many side streams")
    parser.add_argument("--extra-op", choices=["add", "mul"], default="add",
                        help="the kernel of the extra graphs (and of --warm-streams): the probe's own (add) or another")
    parser.add_argument("--streams", choices=["side", "one", "fresh"], default="side")
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()

    x = torch.zeros(256, device="cuda")
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    if args.streams == "one":
        torch.cuda.set_stream(stream)
    kept = []  # what the extra graphs allocated, alive as long as they are

    def adds(count: int, extra_bytes: int = 0, op: str = "add"):
        def build():
            if extra_bytes:
                kept.append(torch.empty(extra_bytes, dtype=torch.uint8, device="cuda"))
            for _ in range(count):
                getattr(x, op + "_")(1.0)
        return build

    def report(graphs: int, note: str = "") -> None:
        us = replay_us(probe, args.replays)
        print(json.dumps({**vars(args), "graphs": graphs, "note": note, "replay_us": round(us, 1),
                          "us_per_kernel": round(us / args.nodes, 3)}), flush=True)

    for _ in range(args.warm_streams):
        with torch.cuda.stream(torch.cuda.Stream()):
            adds(8, op=args.extra_op)()
        torch.cuda.synchronize()
    probe = capture(adds(args.nodes), pool, args.capture, stream)
    report(1)
    extras = []
    for i in range(args.extras):
        kept_graph = args.extras_instantiate != "torch"
        capture_stream = torch.cuda.Stream() if args.streams == "fresh" else stream
        extras.append(capture(adds(args.extra_nodes, args.extra_bytes, args.extra_op), pool, args.capture,
                              capture_stream, kept_graph))
        if args.extras_instantiate.startswith("raw:"):
            instantiate_raw(extras[-1], int(args.extras_instantiate[4:]))
        kept.clear()
        report(2 + i)
    extras.clear()
    gc.collect()
    torch.cuda.empty_cache()
    report(1, "extras destroyed")
    probe = capture(adds(args.nodes, op="sub"), pool, args.capture, stream)
    report(1, "a new probe of a kernel not used before (sub)")


if __name__ == "__main__":
    main()
