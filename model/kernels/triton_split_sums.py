"""Split-K partials added in the same launch: the last program of a tile to arrive adds them.

A kernel that splits K over several programs per output tile (``triton_gemv``) has each program
store its fp32 partial sums and then count itself in its tile's counter (``last_to_arrive``). The program that counts last loads the tile's partials in split
order, adds them (``sum_partials``: the same bits whichever program came last), finishes the tile and
puts the counter back to zero for the next launch. This replaces a second launch that adds the splits
(``triton_decode_mm``'s ``_sum_splits_kernel``: ~2 µs per product inside a CUDA graph on one H200). (The
routed experts' warpgroup kernels, ``triton_moe``, split this way at one to eight tokens were no faster
on one H200: their programs are bound by expanding the FP4 weights; ``triton_mma_experts`` splits this
way; ``docs/benchmarks-log.md``.)

Memory ordering: a program's partial stores are complete before it counts (a barrier over its
threads, then an ``acq_rel`` atomic at GPU scope, which orders them before the count); the last
program's acquire makes every other program's stores visible to it, and it reads them from L2
(``.cg``) so that no stale line of its own SM's L1 is used.

The counters (``split_counters``) are one int32 array per device and lane, made once and left at zero by
every launch. They assume the kernels that use them run one at a time per lane: two launches running at
once would share counters. The engine runs a forward's products on one stream, except the work it starts
beside them on a second one (``side_stream.py``), which counts in lane 1. (A kernel started early by
programmatic dependent launch touches the counters only after its wait for the kernel before it:
``triton_dependent_launch``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .side_stream import lane

MAX_TILES = 1 << 16  # counters per device: the output tiles of one launch
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def last_to_arrive(counter_ptr, splits):
    """Count this program in its tile's counter once its partial is stored: whether it is the tile's
    last of ``splits`` (that program adds the partials and must call ``reset_counter``)."""
    tl.debug_barrier()  # all of this program's partial is stored before it counts itself
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")  # the others' partials visible after
    return arrived == splits - 1


@triton.jit
def sum_partials(part_ptrs, splits, stride, mask):
    """The ``splits`` fp32 partials at ``part_ptrs`` (split 0's; the others ``stride`` apart) added in
    split order.

    The loads of four splits are issued before any of them is added: a loop that loads and adds one
    split at a time waits a whole L2 round trip per split, and the program that adds runs alone at
    the end of the launch (with 10-50 splits, microseconds of a product of a few microseconds). (Eight
    at a time made ptxas spill a register in ``triton_gemv``'s main loop.) The
    additions stay one by one in split order (a split past the last is not added at all: adding a zero
    would turn -0.0 into +0.0), so the bits do not change."""
    total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for first in range(1, splits, 4):
        total = _add_four(total, _load_four(part_ptrs, first, splits, stride, mask), first, splits)
    return total


@triton.jit
def _load_four(part_ptrs, first, splits, stride, mask):
    """The partials of splits ``first`` .. ``first + 3`` (past the last split: the last one's again,
    which ``_add_four`` does not add)."""
    last = splits - 1
    return (tl.load(part_ptrs + tl.minimum(first, last) * stride, mask=mask, other=0.0, cache_modifier=".cg"),
            tl.load(part_ptrs + tl.minimum(first + 1, last) * stride, mask=mask, other=0.0, cache_modifier=".cg"),
            tl.load(part_ptrs + tl.minimum(first + 2, last) * stride, mask=mask, other=0.0, cache_modifier=".cg"),
            tl.load(part_ptrs + tl.minimum(first + 3, last) * stride, mask=mask, other=0.0, cache_modifier=".cg"))


@triton.jit
def _add_four(total, four, first, splits):
    """``total`` plus those of the four partials that belong to a split, in split order."""
    p0, p1, p2, p3 = four
    total = tl.where(first < splits, total + p0, total)
    total = tl.where(first + 1 < splits, total + p1, total)
    total = tl.where(first + 2 < splits, total + p2, total)
    return tl.where(first + 3 < splits, total + p3, total)


@triton.jit
def reset_counter(counter_ptr):
    tl.atomic_xchg(counter_ptr, 0)  # for the next launch, or the next replay of a CUDA graph


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The tile counters of the device and of the current lane (``side_stream.lane``; int32 zeros, every
    launch leaves them at zero). Made at the first call, which must not be inside a CUDA graph capture (the
    engine runs every graph's forward once eagerly before capturing it)."""
    if tiles > MAX_TILES:
        raise ValueError(f"{tiles} output tiles exceed the {MAX_TILES} split counters")
    key = (device, lane())
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split counters must exist before a CUDA graph is captured")
        counters = _counters[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters
