"""The one CUDA stream a worker runs all its device work on: loading, profiling, capture and steps.

Why one stream, and not the default one:

* A CUDA graph cannot be captured on the default stream, so captures need a stream of their own.
  ``torch.cuda.graph`` takes a side stream for them, while everything else runs on the default one.
* On one H200 (torch 2.11, CUDA 13, driver 580) that costs every replay ~0.18 µs per kernel, ~6% of
  a batch-1 decode step, as soon as the process has run kernels on a second stream, or made a fourth
  capture on one that is not the stream its work runs on. The state is for the whole process and
  permanent: a new graph of a kernel never used before replays slowly too, and destroying graphs
  does not help. A process whose kernels, captures and replays all run on one stream stays fast with
  any number of graphs (``benchmarks/graph_count_probe.py``; ``docs/benchmarks-log.md``, "One stream").

So the worker takes a stream of its own and makes it current *before its first kernel*, and its
decode graphs are captured on that same stream (``workers/cuda_graphs.py``). If the thread's current
stream is already a side stream (a caller of the in-process ``LLM`` that runs its own work there, as
``benchmarks/decode.py`` does), the worker adopts it instead, so that caller and engine share one
stream too. Under expert parallelism NCCL runs its collectives on streams of its own, so a worker
with ``--dp N`` is not a one-stream process whatever it does here.

The model's own second stream is the exception (``model/kernels/side_stream.py``): mHC's coefficients, the
shared expert, the compressors and Engram's lookups run beside the launches that follow them, forked from and
joined back into this stream inside every forward, so a decode graph has two branches. That is a process that
runs kernels on a second stream, and pays the cost above; it is on because the overlap measured more than that
cost (on one H100, 1-3% of a decode step at batch 1-256: ``tile_configs.SIDE_STREAM``, whose off keeps
everything on this one stream; ``docs/benchmarks-log.md``).

The current stream is a thread's own: a thread that steps the runner other than the one that made
it calls ``enter`` first (cheap when nothing changes), so its steps run, and replay, on the same
stream.
"""

from __future__ import annotations

import threading

import torch


class WorkerStream:
    """The stream of one worker (None on a CPU device), current in every thread that ``enter``\\ s it."""

    def __init__(self, device: torch.device):
        self.stream: torch.cuda.Stream | None = None
        self._made_current = threading.local()  # per thread: True once the stream is current there
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        if current == torch.cuda.default_stream(device):
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(current)  # after whatever the default stream was given before
        else:
            self.stream = current
        self.enter()

    def enter(self) -> None:
        """Make the stream current for the calling thread (an attribute lookup once it is)."""
        if self.stream is not None and not getattr(self._made_current, "done", False):
            torch.cuda.set_stream(self.stream)
            self._made_current.done = True
