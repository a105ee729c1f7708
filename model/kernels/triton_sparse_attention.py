"""Triton kernel of the sparse attention with sink (twin: ``model.sparse_attention.sparse_attention_padded``).

``sparse_attention(q, pool, index, valid, sink, scale)``: each query row ``t`` and head ``h`` attends
to the row's listed KV rows ``pool[index[t, :L]]`` (K and V are the same vector; ``valid[t] ==
False`` marks a hole), with the twin's arithmetic on ``kv_rows = pool[index]``: an online softmax
over blocks of 64 listed entries (columns past ``L`` are holes, as the twin's padding to whole
blocks makes them); scores in fp32 from
bf16 x bf16 products, holes at -inf, times ``scale``; a running max that starts at -1e30;
``p = exp(scores - max)``; the denominator sums the fp32 ``p``, the numerator the products of ``p``
rounded to bf16 with the KV rows (fp32 accumulation); at the end ``exp(sink[h] - max)`` joins the
denominator only (the sink is not scaled) and ``out = bf16(acc / sum)``. A row without any valid
entry yields zeros.

Layouts: q ``[T, H, D]``, pool ``[R, D]`` bf16 (last dims contiguous), index ``[T, L]`` int32 or int64 (any
value at a hole), valid ``[T, L]`` bool, sink ``[H]`` fp32; out ``[T, H, D]`` bf16. The pool holds
each row once however many queries list it: the rows of a prefill chunk and the compressed entries
of its sequence are shared by thousands of queries, which would otherwise each get a copy. One
launch for a whole layer, any T, L and R: no shape depends on the values, so a decode step replays
it in a CUDA graph.

Grid: one program per query row and block of up to 64 heads (V4.1: all 64 heads of a row in one
program; a few rows also split their entries, below). The heads are the products' row side, as in FlashMLA's layout: ``scores = q kv^T``
``[heads, 64]`` and ``out += p kv`` ``[heads, D]``, so a row's 64 heads fill the 64 rows that Hopper's
warpgroup instructions take, each 64-entry KV block ``[64, D]`` is gathered from the pool once per
row (straight into shared memory, one block ahead) and serves every head in both products, and ``p``
feeds the second product from registers. The output accumulator (64 x 512 fp32 at V4.1's width) is
128 registers per thread with 8 warps; the compiler keeps part of the addressing in local memory (a
few dozen registers' worth, L1-resident), which costs less than any smaller layout saves. Measured
on one H200 against the earlier layout (heads as the narrow side, 16 or 32 per program, each KV block
read by 2-4 programs; microbenchmark, 64 heads of 512, 640 random entries per row): 4.13 against
8.47 ms at 8,192 rows (166 against 81 TFLOP/s), 149 against 302 µs at 256 rows, 75 against 81 µs at
64; slower only for a few rows (72 against 47 µs at one row), where one program per row leaves most
SMs idle. So outside the batch-invariant mode up to ``FEW_ROWS`` rows (a small decode step) take 16
heads per program instead: four programs per row of V4.1's 64 heads. Only the products' instruction
shape changes (the order of their fp32 sums), not the arithmetic, so the twin's tolerance is the same.
Those rows also split their listed entries over programs (``split_config``: two programs per SM, whole
blocks each), as flash-decoding does: each split runs the online softmax over its blocks and writes its
running max, sum and unnormalized output in fp32; ``_combine_splits_kernel`` brings them to the largest
maximum, adds them in split order, adds the sink and divides. A one-token step of V4.1-Flash then runs
40 programs per layer instead of 4. The arithmetic differs from the twin in one place: each split
rounds ``p`` to bf16 against its own running maximum, not the twin's, so more outputs differ from the
twin by one ulp, within the same bound (``tests/test_triton_sparse_attention.py``). The batch-invariant
mode never splits.

The output's RoPE (``positions`` and ``table``: ``TritonKernels.sparse_attention_rotated_back``): where the rows
split, ``_combine_splits_kernel`` rotates the output's last dims back before it stores them, holding each pair in one
thread's registers, with ``_rope_kernel``'s arithmetic (the bits of ``rotate_`` after the attention, one launch
fewer); elsewhere ``rotate_`` runs after the attention. Taking the queries' rotation and the unsplit output's into
the main launch was measured slower (``docs/benchmarks-log.md``): it adds dependent loads and barriers to every program.

Every elementwise step is the twin's, in its order: fp32 fusion is off (the twin rounds each
product and each sum), the division is IEEE's and ``exp`` is CUDA's ``expf`` (what torch runs).
Results differ from the twin only through the order of the fp32 sums: inside the two products,
in the 64-entry sum of ``p``, and because the compiler folds ``acc * rescale + P.V`` into the
product's accumulation (``tests/test_triton_sparse_attention.py`` states the resulting tolerance).

Blocks of holes: in the twin a block without a valid entry leaves the running max, the sum and the
output exactly as they were. The kernel first reads the row's ``valid`` flags and runs only the
blocks from the first valid entry's to the last's (padding costs nothing, and a plain loop keeps
the KV loads streaming: an ``if`` around a block's work would stop the compiler from prefetching);
holes inside that range are masked out of the loads, so they cost no memory traffic. Padding a row
with holes changes no bit; a row without a valid entry runs no block.

Batch invariance: a program owns its row's heads and walks the row's blocks in order, and in the
batch-invariant mode the launch configuration depends on H and D only; nothing depends on T or on the
other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, bf16_exact, dot_bf16, exp_f32, sm_count, to_bf16
from .triton_rope import rotate_

BLOCK_L = 64  # listed entries per online-softmax step: the twin's block
MAX_BLOCK_H = 64  # heads per program: the warpgroup instructions' 64 rows
NUM_STAGES = 2  # KV blocks in flight: q and 2 x 64 KB of shared memory at 64 heads of 512 (192 KB)
FEW_ROWS = 16  # up to this many rows (outside the batch-invariant mode): 16 heads per program
EMPTY_MAX = -1e30  # the twin's start of the running max: finite, so exp(old - new) is 0 on the first block


@triton.jit
def _sparse_attention_kernel(q_ptr, pool_ptr, index_ptr, valid_ptr, sink_ptr, out_ptr, max_ptr, sum_ptr, scale,
                             H, D, L, split_len, stride_qt, stride_qh, stride_pool, stride_it, stride_vt, stride_ot,
                             stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                             EMPTY_MAX: tl.constexpr, SPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
    # SPLIT: program (row and heads, split) runs the row's entries split * split_len .. (a whole number of
    # blocks) and writes its running max, sum and unnormalized output (fp32) for _combine_splits_kernel
    split = tl.program_id(1)
    head_blocks = tl.cdiv(H, BLOCK_H)
    row = (tl.program_id(0) // head_blocks).to(tl.int64)
    offs_h = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, BLOCK_L)
    h_mask = offs_h < H
    d_mask = offs_d < D
    q = tl.load(q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    index_ptr += row * stride_it
    valid_ptr += row * stride_vt
    # the blocks from the first valid entry's to the last's (blocks of holes change nothing)
    begin = split * split_len
    end = tl.minimum(begin + split_len, L)
    first = end
    last = -1
    for start in range(begin, end, BLOCK_L):
        cols = start + offs_l
        ok = tl.load(valid_ptr + cols, mask=cols < end, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(ok, cols, end), axis=0))
        last = tl.maximum(last, tl.max(tl.where(ok, cols, -1), axis=0))
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    sum_exp = tl.zeros((BLOCK_H,), dtype=tl.float32)
    running_max = tl.full((BLOCK_H,), EMPTY_MAX, dtype=tl.float32)
    for start in range(first - first % BLOCK_L, last + 1, BLOCK_L):
        cols = start + offs_l
        ok = tl.load(valid_ptr + cols, mask=cols < end, other=0) != 0
        entry = tl.load(index_ptr + cols, mask=ok, other=0).to(tl.int64)
        kv = tl.load(pool_ptr + entry[:, None] * stride_pool + offs_d[None, :],
                     mask=ok[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_L, BLOCK_D]; holes: zeros, not read
        scores = tl.where(ok[None, :], dot_bf16(q, tl.trans(kv), INTERPRETED), -float("inf")) * scale
        block_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [BLOCK_H]
        rescale = exp_f32(running_max - block_max, INTERPRETED)
        p = exp_f32(scores - block_max[:, None], INTERPRETED)  # [BLOCK_H, BLOCK_L]
        sum_exp = sum_exp * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + dot_bf16(to_bf16(p, INTERPRETED), kv, INTERPRETED)
        running_max = block_max
    if SPLIT:
        splits = tl.num_programs(1)
        at = (row * splits + split) * H + offs_h  # [T, splits, H] (and D per head for the output)
        tl.store(max_ptr + at, running_max, mask=h_mask)
        tl.store(sum_ptr + at, sum_exp, mask=h_mask)
        tl.store(out_ptr + at[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
        return
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    # no valid entry (the running max still at its start): the twin's 0 / inf; here 0 / 1, exact zeros
    # as well, without overflowing exp(sink + 1e30)
    seen = running_max > EMPTY_MAX
    sum_exp = sum_exp + exp_f32(tl.where(seen, sink - running_max, 0.0), INTERPRETED)
    out = tl.div_rn(acc, sum_exp[:, None])
    tl.store(out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], to_bf16(out, INTERPRETED),
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(acc_ptr, max_ptr, sum_ptr, sink_ptr, out_ptr, pos_ptr, table_ptr, H, D, SPLITS, stride_ot,
                           stride_oh, stride_p, BLOCK_D: tl.constexpr, EMPTY_MAX: tl.constexpr,
                           ROPE_DIMS: tl.constexpr, INTERPRETED: tl.constexpr):
    """One (row, head): its splits' running maxima, sums and unnormalized outputs brought to the largest
    maximum and added in split order; then the sink joins the denominator, as in the unsplit kernel.
    ``ROPE_DIMS``: the output's last dims then rotated back at the row's position, as ``rotate_`` would
    rotate the stored output. The values are held as ``[BLOCK_D / 2, 2]`` pairs, each in one thread's
    registers, so the rotation exchanges nothing between threads (every step is elementwise: the shape
    changes no bit)."""
    row, head = tl.program_id(0) // H, tl.program_id(0) % H
    offs_d = 2 * tl.arange(0, BLOCK_D // 2)[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_D / 2, 2]
    d_mask = offs_d < D
    if ROPE_DIMS:  # issued first: the rotation's loads overlap the splits'
        # (cos, sin) of each rotated pair, loaded as pairs too: in the output pairs' registers
        rotated = (offs_d >= D - ROPE_DIMS) & d_mask
        table_row = table_ptr + tl.load(pos_ptr + row).to(tl.int64) * stride_p
        cos, sin = tl.split(tl.load(table_row + tl.where(rotated, offs_d - (D - ROPE_DIMS), 0), mask=rotated,
                                    other=0.0))
        rotated_pair, _ = tl.split(rotated)
        sin = -sin  # rotated back: the conjugate
    first = row * SPLITS * H + head  # split s of this (row, head): first + s * H
    top = tl.load(max_ptr + first)
    for s in range(1, SPLITS):
        top = tl.maximum(top, tl.load(max_ptr + first + s * H))
    acc = tl.zeros((BLOCK_D // 2, 2), dtype=tl.float32)
    sum_exp = 0.0
    for s in range(0, SPLITS):
        rescale = exp_f32(tl.load(max_ptr + first + s * H) - top, INTERPRETED)
        sum_exp = sum_exp + tl.load(sum_ptr + first + s * H) * rescale
        acc = acc + tl.load(acc_ptr + (first + s * H) * D + offs_d, mask=d_mask, other=0.0) * rescale
    sink = tl.load(sink_ptr + head)
    sum_exp = sum_exp + exp_f32(tl.where(top > EMPTY_MAX, sink - top, 0.0), INTERPRETED)
    out = to_bf16(tl.div_rn(acc, sum_exp), INTERPRETED)
    if ROPE_DIMS:
        a, b = tl.split(bf16_exact(out))  # each pair of the output as rotate_ reads it
        out = to_bf16(tl.join(tl.where(rotated_pair, a * cos - b * sin, a),  # _rope_kernel's arithmetic, in its order
                              tl.where(rotated_pair, a * sin + b * cos, b)), INTERPRETED)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out, mask=d_mask)


def launch_config(h: int, d: int, narrow_heads: bool = False) -> tuple[int, int, int]:
    """(heads per program, padded head width, warps) for ``h`` heads of ``d``: from the model's shape
    only (batch invariance), unless ``narrow_heads`` (the caller's choice for a few rows, outside the
    batch-invariant mode): then 16 heads per program, so that a row's heads run on several SMs."""
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(h)))
    block_d = max(16, triton.next_power_of_2(d))
    if narrow_heads:  # 16-row products (mma, not wgmma); 8 warps keep the [16, 512] accumulator out of local memory
        return 16, block_d, 8 if block_d >= 256 else 4
    return block_h, block_d, 8 if block_h * block_d >= 64 * 256 else 4


def few_rows(t: int) -> bool:
    """Whether ``t`` query rows run faster with 16 heads per program than with all of a row's heads in
    one: a few rows (one per sequence of a small decode step) would leave most SMs idle."""
    return t <= FEW_ROWS


def split_config(programs: int, length: int, sms: int) -> tuple[int, int]:
    """(splits, listed entries per split, a whole number of blocks) for a few rows: enough programs
    for two per SM, at least one block each."""
    blocks = triton.cdiv(length, BLOCK_L)
    wanted = min(blocks, max(1, triton.cdiv(2 * sms, programs)))
    per_split = triton.cdiv(blocks, wanted)
    return triton.cdiv(blocks, per_split), per_split * BLOCK_L


def sparse_attention(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                     sink: torch.Tensor, scale: float, batch_invariant: bool = True,
                     positions: torch.Tensor | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[T, H, D]`` bf16 over each row's listed KV rows ``pool[index[t]]`` (``pool [R, D]`` bf16,
    ``index [T, L]`` integer, ``valid [T, L]`` bool, False: a hole), with ``sink [H]`` fp32 ->
    ``[T, H, D]`` bf16 (see the module docstring). Without ``batch_invariant`` a few rows take 16
    heads per program. With ``positions [T]`` and ``table`` (complex64 ``[P, R / 2]``, a ``RotaryTable``'s)
    the output's last R dims come rotated back (``rotate_(..., inverse=True)``'s bits): by the combining
    launch where the rows split their entries, by ``rotate_`` after the attention elsewhere."""
    t, h, d = q.shape
    length = index.shape[1]
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    if t == 0 or h == 0 or d == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if pool.stride(-1) != 1:
        pool = pool.contiguous()
    if index.dtype not in (torch.int32, torch.int64):  # int64 lists are read as they are: no conversion launch
        index = index.long()
    index = index.contiguous()
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    valid = valid.view(torch.uint8)  # same bytes; a bool pointer is awkward in a kernel
    sink = sink.float().contiguous()
    narrow = not batch_invariant and few_rows(t)
    block_h, block_d, warps = launch_config(h, d, narrow_heads=narrow)
    programs = t * triton.cdiv(h, block_h)
    splits, split_len = split_config(programs, length, sm_count(q.device)) if narrow else (1, length)
    if splits > 1:
        acc = torch.empty(t, splits, h, d, dtype=torch.float32, device=q.device)
        maxima = torch.empty(t, splits, h, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxima)
        target = acc
    else:
        target = maxima = sums = out
    _sparse_attention_kernel[(programs, splits)](
        q, pool, index, valid, sink, target, maxima, sums, float(scale), h, d, length, split_len,
        q.stride(0), q.stride(1), pool.stride(0), index.stride(0), valid.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_L=BLOCK_L, EMPTY_MAX=EMPTY_MAX, SPLIT=splits > 1,
        INTERPRETED=INTERPRETED, num_warps=warps, num_stages=NUM_STAGES, enable_fp_fusion=False)
    if splits > 1:
        rope_dims, real, at = 0, sink, sink  # without RoPE the table's and the positions' pointers are not read
        if table is not None:
            rope_dims, real, at = 2 * table.shape[-1], torch.view_as_real(table), positions
        assert (d - rope_dims) % 2 == 0, (d, rope_dims)
        _combine_splits_kernel[(t * h,)](acc, maxima, sums, sink, out, at, real, h, d, splits, out.stride(0),
                                         out.stride(1), real.stride(0), BLOCK_D=block_d, EMPTY_MAX=EMPTY_MAX,
                                         ROPE_DIMS=rope_dims, INTERPRETED=INTERPRETED, num_warps=4,
                                         enable_fp_fusion=False)
    elif table is not None:
        rotate_(out[..., -2 * table.shape[-1]:], positions, table, inverse=True)
    return out
