"""One Triton launch that sorts a step's (token, expert) pairs by expert and cuts them into blocks.

``align_pairs(pair_expert, num_experts, block_m)`` gives exactly what ``triton_moe.align_pairs_torch``
gives (``tests/test_triton_align_pairs.py`` compares them element for element):

* ``sorted_pair [P]``: the pair ids expert by expert, in pair order within one expert (a stable
  sort); pairs whose expert is outside ``[0, num_experts)`` come last, in pair order;
* ``expert_start [E]``, ``expert_count [E]``: where each expert's pairs start in ``sorted_pair`` and
  how many there are;
* ``block_expert [NB]``, ``block_index [NB]``: block ``b`` covers rows ``block_index[b] * block_m ..``
  of expert ``block_expert[b]`` (-1: an unused block), ``NB = cdiv(P, block_m) + min(E, P)``, an
  upper bound known without reading anything back.

Why a kernel: in torch this is ~18 operations (a scatter-add histogram, a stable radix argsort of
several kernels, two cumulative sums, a searchsorted, gathers, ``where``s): ~25 kernels of 1-3 µs
each in every MoE layer of a decode step, more than the experts' own weight streaming takes at one
token (``docs/benchmarks-log.md``). Here one program does all of it: a counting sort.

1. Histogram of the expert ids, chunk by chunk (``tl.histogram``), and its exclusive prefix sum: each
   expert's start.
2. The chunks again, in order: a pair's place is its expert's running cursor plus the number of
   earlier pairs of the same expert in its chunk (a ``[C, C]`` comparison); the cursors then advance
   by the chunk's histogram. The cursors stay in registers and are read by key with ``tl.gather``
   (through shared memory), where a scratch buffer in global memory cost two barriers and an L2
   round trip per chunk.
3. Blocks: ``cdiv(count, block_m)`` per expert, their inclusive prefix sum ``block_end``; block ``b``
   belongs to the number of experts whose ``block_end <= b`` (searchsorted, right side).

With ``zero_rows`` (the experts' ``[P, D]`` output) step 2 also zeroes the rows of pairs of no local
expert, the rows the experts' kernels do not write. This replaces a memset of the whole output before
the experts' launches; a memset takes no part in programmatic dependent launch, so it was a gap in
their chain.

One program, so it pays only for small steps: the launcher uses it up to ``MAX_PAIRS`` pairs (decode
steps up to ~680 tokens of 6 experts) and the torch version above, which sorts on every SM. Its chunks
are no wider than the step needs (``chunk_sizes``): a one-token step's 6 pairs and 7 blocks compared
in ``[128, 128]`` and ``[64, bins]`` tiles cost most of its ~8 µs on one H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel

MAX_PAIRS = 4096  # above: the torch version (its sort uses the whole GPU; this kernel one SM)
CHUNK = 128  # pairs compared with each other at once ([CHUNK, CHUNK] in registers), at most
BLOCK_CHUNK = 64  # blocks mapped to their expert at once ([BLOCK_CHUNK, bins]), at most
MIN_CHUNK = 16  # the narrowest chunks (a few compiled variants cover every decode step)
ZERO_COLS: tl.constexpr = tl.constexpr(64)  # columns of the foreign pairs' rows zeroed per store


def chunk_sizes(pairs: int, blocks: int) -> tuple[int, int]:
    """(pairs per chunk, blocks per chunk): powers of two no wider than the step needs."""
    def fit(n: int, widest: int) -> int:
        return min(widest, max(MIN_CHUNK, triton.next_power_of_2(max(n, 1))))
    return fit(pairs, CHUNK), fit(blocks, BLOCK_CHUNK)


@triton.jit
def _align_pairs_kernel(expert_ptr, sorted_ptr, start_ptr, count_ptr, block_expert_ptr, block_index_ptr,
                        zero_ptr, P, E, NB, block_m, D,
                        BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr, ZERO: tl.constexpr,
                        PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    # 1. counts per key: experts 0..E-1, E for pairs of no local expert, E + 1 for lanes past P
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for first in range(0, P, CHUNK):
        counts += tl.histogram(_keys(expert_ptr, first + lanes, P, E), BINS)
    starts = tl.cumsum(counts, 0) - counts  # exclusive: key E starts after every valid pair
    tl.store(start_ptr + bins, starts.to(tl.int64), mask=bins < E)
    tl.store(count_ptr + bins, counts.to(tl.int64), mask=bins < E)
    # 2. stable counting sort; the running cursors stay in registers (a gather reads them by key)
    cursors = starts
    earlier = lanes[None, :] < lanes[:, None]  # [i, j]: j comes before i
    for first in range(0, P, CHUNK):
        pair = first + lanes
        keys = _keys(expert_ptr, pair, P, E)
        same_before = tl.sum(((keys[:, None] == keys[None, :]) & earlier).to(tl.int32), axis=1)
        place = tl.gather(cursors, keys, 0) + same_before
        tl.store(sorted_ptr + place, pair.to(tl.int64), mask=pair < P)
        cursors += tl.histogram(keys, BINS)
        if ZERO:
            _zero_foreign_rows(zero_ptr, pair, keys == E, D, CHUNK)
    # 3. blocks of block_m rows per expert, in expert order
    blocks = tl.where(bins < E, (counts + block_m - 1) // block_m, 0)
    block_end = tl.cumsum(blocks, 0)
    block_start = block_end - blocks
    for first in range(0, NB, BLOCK_CHUNK):
        b = first + tl.arange(0, BLOCK_CHUNK)
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # searchsorted, right
        in_use = owner < E
        owner = tl.minimum(owner, E - 1)
        index = b - tl.gather(block_start, owner, 0)
        tl.store(block_expert_ptr + b, tl.where(in_use, owner, -1).to(tl.int64), mask=b < NB)
        tl.store(block_index_ptr + b, index.to(tl.int64), mask=b < NB)


@triton.jit
def _zero_foreign_rows(zero_ptr, pair, foreign, D, CHUNK: tl.constexpr):
    """Zero the ``D``-wide rows of ``zero_ptr`` of the chunk's pairs of no local expert (none at one
    rank: then nothing is stored)."""
    if tl.max(foreign.to(tl.int32), 0) > 0:
        rows = zero_ptr + pair.to(tl.int64)[:, None] * D
        for first_col in range(0, D, ZERO_COLS):
            cols = first_col + tl.arange(0, ZERO_COLS)
            zeros = tl.zeros((CHUNK, ZERO_COLS), dtype=zero_ptr.dtype.element_ty)
            tl.store(rows + cols[None, :], zeros, mask=foreign[:, None] & (cols < D)[None, :])


@triton.jit
def _keys(expert_ptr, pair, P, E):
    expert = tl.load(expert_ptr + pair, mask=pair < P, other=0).to(tl.int32)
    key = tl.where((expert >= 0) & (expert < E), expert, E)
    return tl.where(pair < P, key, E + 1)


def align_pairs(pair_expert: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False,
                zero_rows: torch.Tensor | None = None):
    """``(sorted_pair, expert_start, expert_count, block_expert, block_index)``, int64 (module
    docstring); ``pair_expert [P]`` integer with P <= ``MAX_PAIRS``; ``pdl``: programmatic dependent
    launch where the GPU has it (``triton_dependent_launch``).

    ``zero_rows``: a contiguous ``[P, D]`` tensor (the experts' output) whose rows of pairs of no
    local expert this launch sets to zero, the rows the experts' kernels do not write. It replaces a
    memset of the whole output before the experts' chain of launches (a memset takes no part in
    programmatic dependent launch)."""
    p = pair_expert.shape[0]
    if p > MAX_PAIRS:
        raise ValueError(f"align_pairs takes at most {MAX_PAIRS} pairs in one program, got {p}")
    device = pair_expert.device
    num_blocks = triton.cdiv(p, block_m) + min(num_experts, p)
    sorted_pair = torch.empty(p, dtype=torch.int64, device=device)
    start = torch.empty(num_experts, dtype=torch.int64, device=device)
    count = torch.empty(num_experts, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=device)
    block_index = torch.empty(num_blocks, dtype=torch.int64, device=device)
    bins = triton.next_power_of_2(num_experts + 2)
    chunk, block_chunk = chunk_sizes(p, num_blocks)
    if zero_rows is not None and (zero_rows.shape[0] != p or zero_rows.dim() != 2 or not zero_rows.is_contiguous()):
        raise ValueError(f"zero_rows must be a contiguous [{p}, D] tensor, got {tuple(zero_rows.shape)}")
    _align_pairs_kernel[(1,)](pair_expert.contiguous(), sorted_pair, start, count, block_expert, block_index,
                              sorted_pair if zero_rows is None else zero_rows, p, num_experts, num_blocks, block_m,
                              0 if zero_rows is None else zero_rows.shape[1],
                              BINS=bins, CHUNK=chunk, BLOCK_CHUNK=block_chunk, ZERO=zero_rows is not None,
                              num_warps=4,
                              **launch_arguments(pdl, device))
    return sorted_pair, start, count, block_expert, block_index
