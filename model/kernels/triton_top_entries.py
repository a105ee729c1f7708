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
   few compares per thread and one block-wide sum instead of re-reading the row. A longer row is
   re-read ``BLOCK`` entries at a time in every pass.
3. One pass keeps every key above it and the first ``k - #(key > t)`` keys equal to it (ties to the
   lower entry), and writes each kept entry at its rank among the kept ones, which is the
   increasing entry order. One prefix sum counts both the keys above ``t`` and the ties before each
   key (two 16-bit fields of one int32).

What makes it fast (one H200, one row, µs): the row is loaded in whole 16-byte chunks from the
chunk the row starts in, so each thread holds runs of eight neighbouring entries and step 3's prefix
sum adds them in the thread before it adds across threads (with single-entry loads, which the
compiler uses when it cannot prove a row starts on a 16-byte boundary, the sum cost ~6,000
instructions per thread at 16,384 entries); a row a little longer than a power of two is held as
that power of two plus a short tail tile (8,216 entries, the benchmark's 8K bucket: 8,192 + 32
instead of 16,384). Before -> after: 8,192 entries 10.9 -> 9.7; 8,216 entries 36.4 -> 10.3; 16,384
entries 22.6 -> 17.6.

Counts and ranks carry over from one ``BLOCK`` of a long row to the next. One program per row: no
result depends on the batch. Integer arithmetic only, so the entries equal the twin's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import sm_count

MAX_BLOCK = 4096  # entries per step of a row re-read in every pass: 16 per thread at 8 warps
MAX_TILE = 16384  # the longest row held in registers: 32 keys per thread at 16 warps
MANY_ROWS_REGISTERS = 128  # per thread, when there are more rows than SMs (``top_entries``)


@triton.jit
def _keys(base, lanes, shift, E):
    """Order-preserving 16-bit keys of bf16 scores (read as int16) at ``lanes`` of a 16-byte aligned
    ``base`` that lies ``shift`` entries before the row's start; -1 outside the row. Each thread reads
    eight neighbouring entries in one 16-byte load, so it holds runs of entries, which the scan of
    step 3 adds within the thread before it adds across threads."""
    limit = (shift + E + 7) // 8 * 8  # whole 16-byte chunks, the last one holding the row's last entry
    bits = tl.load(base + lanes, mask=lanes < limit, other=0).to(tl.int32) & 0xFFFF
    bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
    entry = lanes - shift
    return tl.where((entry >= 0) & (entry < E), key, -1)


@triton.jit
def _count_at_least(base, shift, E, bound, BLOCK: tl.constexpr):
    count = 0
    for start in range(0, shift + E, BLOCK):
        key = _keys(base, start + tl.arange(0, BLOCK), shift, E)
        count += tl.sum((key >= bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _keep_step(out_row, key, entry, threshold, ties_wanted, ties_before, kept_before):
    """Step 3 on one step of a row: write the kept entries of ``key`` (``entry``: their entry ids) at
    their ranks, given the ties and kept entries of the steps before it; returns this step's (ties, kept)."""
    above = (key > threshold).to(tl.int32)
    tie = (key == threshold).to(tl.int32)
    both = (above << 16) | tie  # one scan counts both (a step holds fewer than 2**16 entries)
    before = tl.cumsum(both, axis=0) - both
    ties_seen = ties_before + (before & 0xFFFF)
    kept = (above == 1) | ((tie == 1) & (ties_seen < ties_wanted))
    # the kept entries before this one: those above the threshold, and the first ties up to the wanted
    rank = kept_before + (before >> 16) + tl.minimum(ties_seen, ties_wanted) - tl.minimum(ties_before, ties_wanted)
    tl.store(out_row + rank, entry.to(tl.int64), mask=kept)
    total = tl.sum(both, axis=0)
    ties = total & 0xFFFF
    return ties, (total >> 16) + tl.minimum(ties_before + ties, ties_wanted) - tl.minimum(ties_before, ties_wanted)


@triton.jit
def _top_entries_kernel(scores_ptr, k_ptr, out_ptr, E, K_MAX, stride_s, stride_o, BLOCK: tl.constexpr,
                        TAIL: tl.constexpr, IN_REGISTERS: tl.constexpr, K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = row * stride_s
    aligned = start // 8 * 8  # the row's first 16-byte chunk: its loads are whole chunks
    base = scores_ptr + aligned
    shift = (start - aligned).to(tl.int32)
    out_row = out_ptr + row * stride_o
    k = tl.minimum(tl.load(k_ptr + row), K_MAX).to(tl.int32)

    threshold = 0  # the k-th largest key (0xFFFF when k = 0: nothing is above it)
    if IN_REGISTERS:
        # the row as one tile of BLOCK keys, and a TAIL tile after it when that is shorter than
        # doubling the first (8,216 entries: 8,192 + 32 instead of 16,384), held for every pass
        key = _keys(base, tl.arange(0, BLOCK), shift, E)
        if TAIL > 0:
            tail = _keys(base, BLOCK + tl.arange(0, TAIL), shift, E)
        for bit in tl.static_range(15, -1, -1):
            candidate = threshold | (1 << bit)
            count = tl.sum((key >= candidate).to(tl.int32), axis=0)
            if TAIL > 0:
                count += tl.sum((tail >= candidate).to(tl.int32), axis=0)
            threshold = tl.where(count >= k, candidate, threshold)
        ties_wanted = k - tl.sum((key > threshold).to(tl.int32), axis=0)
        if TAIL > 0:
            ties_wanted -= tl.sum((tail > threshold).to(tl.int32), axis=0)
        ties_before, kept_before = _keep_step(out_row, key, tl.arange(0, BLOCK) - shift, threshold, ties_wanted, 0, 0)
        if TAIL > 0:
            _, kept = _keep_step(out_row, tail, BLOCK + tl.arange(0, TAIL) - shift, threshold, ties_wanted,
                                 ties_before, kept_before)
            kept_before += kept
    else:
        for bit in tl.static_range(15, -1, -1):
            candidate = threshold | (1 << bit)
            threshold = tl.where(_count_at_least(base, shift, E, candidate, BLOCK) >= k, candidate, threshold)
        ties_wanted = k - _count_at_least(base, shift, E, threshold + 1, BLOCK)
        ties_before = 0
        kept_before = 0
        for step in range(0, shift + E, BLOCK):
            lanes = step + tl.arange(0, BLOCK)
            ties, kept = _keep_step(out_row, _keys(base, lanes, shift, E), lanes - shift, threshold, ties_wanted,
                                    ties_before, kept_before)
            ties_before += ties
            kept_before += kept
    for col in range(0, K_MAX, K_BLOCK):  # unused columns: 0, as the twin leaves them
        cols = col + tl.arange(0, K_BLOCK)
        tl.store(out_row + cols, tl.zeros((K_BLOCK,), tl.int64), mask=(cols >= kept_before) & (cols < K_MAX))


def block_size(width: int, shift_free: bool) -> tuple[int, int, int, bool]:
    """(entries of the first tile or of each step, entries of the tail tile (0: none), warps, whether
    the row is held in registers) for rows of ``width``; ``shift_free``: every row starts on a 16-byte
    boundary (otherwise a row's loads begin up to seven entries before it)."""
    span = width if shift_free else width + 7
    if span <= MAX_TILE:
        block = triton.next_power_of_2(max(span, 16))
        tail = 0
        if block > span and span - block // 2 <= block // 4:  # the part past half the tile fits a quarter
            block //= 2
            tail = max(triton.next_power_of_2(span - block), 16)
        # 32 keys per thread from 4,096 entries on: within 0.1 µs of the fastest of 4-32 warps for one
        # row of 1,024-16,384 entries on one H200 (4,096: 6.7 µs at 4 warps, 7.9 at 32; 8,192: 9.7 at
        # 8, 11.9 at 4; 16,384: 17.5 at 16, 18.7 at 8)
        return block, tail, max(4, block // 1024), True
    return MAX_BLOCK, 0, 8, False


def top_entries(scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
    """Entries ``[S, k_max]`` int64 (module docstring); ``scores [S, E]`` bf16, ``k_per_row [S]`` integers."""
    assert scores.dtype == torch.bfloat16 and scores.dim() == 2, (scores.dtype, tuple(scores.shape))
    rows, width = scores.shape
    if scores.stride(-1) != 1 or scores.data_ptr() % 16:
        scores = scores.clone(memory_format=torch.contiguous_format)  # rows counted from a 16-byte boundary
    out = torch.empty(rows, k_max, dtype=torch.int64, device=scores.device)
    if rows == 0 or k_max == 0:
        return out
    block, tail, warps, in_registers = block_size(width, shift_free=scores.stride(0) % 8 == 0)
    # more rows than SMs (a prefill, a large decode batch): at most 128 registers a thread, so that two
    # 8-warp programs share an SM (8,192 rows of 8,192 entries: 572 -> 435 µs on one H200; one row is
    # latency-bound and keeps the compiler's ~150)
    many_rows = {"maxnreg": MANY_ROWS_REGISTERS} if rows > sm_count(scores.device) else {}
    _top_entries_kernel[(rows,)](scores.view(torch.int16), k_per_row.contiguous(), out, width, k_max,
                                 scores.stride(0), out.stride(0), BLOCK=block, TAIL=tail, IN_REGISTERS=in_registers,
                                 K_BLOCK=min(triton.next_power_of_2(k_max), 1024), num_warps=warps, **many_rows)
    return out
