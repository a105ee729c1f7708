"""Triton kernel of the indexer's top-k (twin: ``model.indexer.top_entries``).

``top_entries(scores, k_per_row, k_max)``: per row of bf16 ``scores [S, E]``, the ``k_per_row``
highest scores, ties to the lower entry, as entry ids in increasing order in the first columns of
``[S, k_max]`` int64 (the other columns 0). The twin gets the same by two stable sorts per row.

Why a kernel: a stable sort of one row is a one-block radix sort (~17-27 µs for the ~2,000 padded
entries of a decode step with an 8K context; three per layer with an indexer), and an 8K prefill
sorts 8,192 rows of 2,048 per layer (~15 ms of its ~300 ms). The selection needs no order, only a
threshold:

1. Each score becomes a 16-bit key whose unsigned order is the scores' order (bf16 bits, the sign
   folded; -0.0 counts as +0.0, as the comparison of floats does; holes past ``E`` are -1).
2. The k-th largest key, bit by bit from the top: the largest ``t`` with ``#(key >= t) >= k`` (16
   counting passes). A row of up to ``MAX_TILE`` entries (a decode step's row up to a 16K context at
   ratio 1) is read once and its keys held in registers across the passes: a decode step has one
   program per row, so the chain of 16 dependent counts is its latency, and each count is then a
   few compares per thread and one block-wide sum instead of re-reading the row (one row of 8,192
   entries: 26.5 -> 11.1 µs on one H200). A longer row is re-read ``BLOCK`` entries at a time in
   every pass.
3. One pass keeps every key above it and the first ``k - #(key > t)`` keys equal to it (ties to the
   lower entry, by a running count), and writes each kept entry at its rank among the kept ones,
   which is the increasing entry order.

Counts and ranks carry over from one ``BLOCK`` of a long row to the next. One program per row: no
result depends on the batch. Integer arithmetic only, so the entries equal the twin's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # entries per step of a row re-read in every pass: 16 per thread at 8 warps
MAX_TILE = 16384  # the longest row held in registers: 32 keys per thread at 16 warps


@triton.jit
def _keys(row_ptr, offs, E):
    """Order-preserving 16-bit keys of bf16 scores (read as int16); -1 past the row's end."""
    mask = offs < E
    bits = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
    return tl.where(mask, key, -1)


@triton.jit
def _count_at_least(row_ptr, E, bound, BLOCK: tl.constexpr):
    count = 0
    for start in range(0, E, BLOCK):
        count += tl.sum((_keys(row_ptr, start + tl.arange(0, BLOCK), E) >= bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _keep_step(out_row, key, offs, threshold, ties_wanted, ties_before, kept_before):
    """Step 3 on one step of a row: write the kept entries of ``key`` (at ``offs``) at their ranks,
    given the ties and kept entries of the steps before it; returns this step's (ties, kept)."""
    tie = (key == threshold).to(tl.int32)
    tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
    kept = ((key > threshold) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
    rank = kept_before + tl.cumsum(kept, axis=0) - kept
    tl.store(out_row + rank, offs.to(tl.int64), mask=kept == 1)
    return tl.sum(tie, axis=0), tl.sum(kept, axis=0)


@triton.jit
def _top_entries_kernel(scores_ptr, k_ptr, out_ptr, E, K_MAX, stride_s, stride_o, BLOCK: tl.constexpr,
                        ONE_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_s
    out_row = out_ptr + row * stride_o
    k = tl.minimum(tl.load(k_ptr + row), K_MAX).to(tl.int32)

    threshold = 0  # the k-th largest key (0xFFFF when k = 0: nothing is above it)
    if ONE_TILE:
        offs = tl.arange(0, BLOCK)
        key = _keys(row_ptr, offs, E)  # held in registers for every pass
        for bit in tl.static_range(15, -1, -1):
            candidate = threshold | (1 << bit)
            threshold = tl.where(tl.sum((key >= candidate).to(tl.int32), axis=0) >= k, candidate, threshold)
        ties_wanted = k - tl.sum((key > threshold).to(tl.int32), axis=0)
        _, kept_before = _keep_step(out_row, key, offs, threshold, ties_wanted, 0, 0)
    else:
        for bit in tl.static_range(15, -1, -1):
            candidate = threshold | (1 << bit)
            threshold = tl.where(_count_at_least(row_ptr, E, candidate, BLOCK) >= k, candidate, threshold)
        ties_wanted = k - _count_at_least(row_ptr, E, threshold + 1, BLOCK)
        ties_before = 0
        kept_before = 0
        for start in range(0, E, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ties, kept = _keep_step(out_row, _keys(row_ptr, offs, E), offs, threshold, ties_wanted, ties_before,
                                    kept_before)
            ties_before += ties
            kept_before += kept
    for start in range(0, K_MAX, BLOCK):  # unused columns: 0, as the twin leaves them
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_row + cols, tl.zeros((BLOCK,), tl.int64), mask=(cols >= kept_before) & (cols < K_MAX))


def block_size(width: int) -> tuple[int, int, bool]:
    """(entries per step, warps, whether the row is one tile held in registers) for rows of ``width``."""
    if width <= MAX_TILE:
        # 32 keys per thread from 4,096 entries on: the fastest of 4-32 warps for one row of 4,096,
        # 8,192 and 16,384 entries on one H200 (7.7, 11.1 and 23.0 µs; 11.4, 17.7 and 32.8 at 32 warps)
        block = triton.next_power_of_2(max(width, 16))
        return block, max(4, block // 1024), True
    return MAX_BLOCK, 8, False


def top_entries(scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
    """Entries ``[S, k_max]`` int64 (module docstring); ``scores [S, E]`` bf16, ``k_per_row [S]`` integers."""
    assert scores.dtype == torch.bfloat16 and scores.dim() == 2, (scores.dtype, tuple(scores.shape))
    rows, width = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(rows, k_max, dtype=torch.int64, device=scores.device)
    if rows == 0 or k_max == 0:
        return out
    block, warps, one_tile = block_size(width)
    _top_entries_kernel[(rows,)](scores.view(torch.int16), k_per_row.contiguous(), out, width, k_max,
                                 scores.stride(0), out.stride(0), BLOCK=block, ONE_TILE=one_tile,
                                 num_warps=warps)
    return out
