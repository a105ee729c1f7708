"""Device work beside the caller's stream: kernels that may run while the ones enqueued after them run.

A decode step is a chain of a few hundred launches on one stream. At small batches most of them are
bound by latency, not by the GPU's bandwidth or its SMs: the GPU runs one small kernel at a time while
most SMs wait. Some pieces of a layer feed none of the launches that follow them directly:

* mHC's coefficients of a sub-layer's stream (``pre``, ``post``, ``comb``: two launches): only the
  sub-layer's expand reads ``post`` and ``comb``, and the *next* sub-layer's collapse ``pre`` (mHC's
  pre-mix is delayed by one sub-layer), so they can run while the sub-layer's own launches run;
* the shared expert (three launches): only the expert sum reads it, so it can run while the router
  and the routed experts run;
* a kv-source layer's compressor (~20 launches in a decode step: its fp32 products, the pooling, the
  index keys, the FP4 round trips, the cache writes): it reads the attention's input and writes the
  entries that the indexer and the attention's gather read, so it runs while the queries are projected;
* Engram's lookup (the table's rows and their projection): it reads the token ids' hashes alone, so
  each Engram layer's runs beside the block before it.

``KernelBackend.beside(like, work)`` starts such work and returns a ``Deferred``; its ``result()``
gives the outputs once the caller's stream may read them. The reference backend (and any tensor off
CUDA) runs the work at once. The Triton backend forks it onto a second stream of the device
(``SideStream``): the side stream first waits for everything enqueued on the caller's stream so far
(the work's inputs), the work is enqueued there, and ``result()`` makes the caller's stream wait for
the side stream. Inside a CUDA graph capture the fork and the join are edges of the graph, which then
has two branches that the GPU runs at the same time; every fork is joined before the forward ends, as
a capture requires.

Memory (torch's caching allocator keeps a freed block for reuse on the stream that allocated it):
the work's outputs and temporaries are allocated on the side stream, and the side stream only runs
again after a later fork, which waits for everything the caller's stream was given before it,
including the last reads of those outputs; its inputs are allocated on the caller's stream and are
still referenced when ``result()`` joins. So no block is reused while another stream may still read
it, without ``record_stream``.

Split counters: kernels whose last program adds the splits count them in per-device counters that
assume one launch at a time (``triton_split_sums``). Work beside the caller runs at the same time as
the caller's kernels, so it counts in counters of its own (``lane``: 1 inside ``beside``'s work, 0
elsewhere).

The order of the kernels changes nothing in their arithmetic: every output is the same bits with or
without the side stream (``tests/test_side_stream.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

_lane = threading.local()


def lane() -> int:
    """The split-counter lane of the kernels being enqueued now: 1 inside work started by ``beside``, else 0."""
    return getattr(_lane, "value", 0)


class Deferred(Generic[T]):
    """Work started beside the caller: ``result()`` is its outputs, readable on the caller's stream."""

    def __init__(self, value: T, join: Callable[[], None] | None = None):
        self._value, self._join = value, join

    def result(self) -> T:
        if self._join is not None:
            self._join()
            self._join = None
        return self._value


class SideStream:
    """A second stream per CUDA device, made at its first use (the engine's eager forward before any
    graph capture) and kept: a capture and its replays see the same stream."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, device: torch.device, work: Callable[[], T]) -> Deferred[T]:
        """``work()`` enqueued on the device's side stream after everything on the current stream."""
        caller = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(caller)  # the work's inputs, and the last reads of the side stream's freed blocks
        outer, _lane.value = lane(), 1
        try:
            with torch.cuda.stream(side):
                value = work()
        finally:
            _lane.value = outer
        return Deferred(value, join=lambda: caller.wait_stream(side))
