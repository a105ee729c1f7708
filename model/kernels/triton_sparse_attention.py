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

Layouts: q ``[T, H, D]``, pool ``[R, D]`` bf16 (last dims contiguous), index ``[T, L]`` int32 (any
value at a hole), valid ``[T, L]`` bool, sink ``[H]`` fp32; out ``[T, H, D]`` bf16. The pool holds
each row once however many queries list it: the rows of a prefill chunk and the compressed entries
of its sequence are shared by thousands of queries, which would otherwise each get a copy. One
launch for a whole layer, any T, L and R: no shape depends on the values, so a decode step replays
it in a CUDA graph.

Grid: one program per (query row, block of ``BLOCK_H`` heads), a row's head blocks side by side.
All heads of a row attend the same KV rows, so each 64-entry KV block ``[64, D]`` is loaded once per
program (gathered from the pool straight into shared memory, a few blocks ahead) and serves all its
heads in both products.
The products are taken transposed, ``scores^T = kv q^T`` ``[64, BLOCK_H]`` and ``out^T += kv^T p^T``
``[D, BLOCK_H]``: the 64 entries and the D features fill the tensor cores' 64-row side and the heads
the narrow side, as ``triton_decode_mm`` does with tokens. Hopper's warpgroup instructions need
multiples of 64 rows, which a block of heads would not give on the row side.

How many heads a program takes (``HEAD_BLOCKS``): 32 heads with 8 warps keep the accumulator at 64
fp32 registers per thread (D = 512) with no spill, and read each KV block once for 32 heads; 16
heads with 4 warps read every row four times for 64 heads, from L2, and issue narrower products:
1.1-1.2x slower from 64 rows up, but faster for a few rows, where 32 heads leave most SMs idle (on one
H200: 51 against 76 µs at 8 rows, 93 against 81 µs at 64). ``sparse_attention`` takes 16 heads
while that fills at most one wave of programs. Both give the same bits on the H200 (a head's sums
are taken in the same order either way; ``test_real_shapes_on_gpu`` checks the bits), so the
choice by T keeps rows independent of their batch. 64 heads in one program would need 128
accumulator registers per thread even with 8 warps, and spill in Triton's code. A row's blocks are never split over programs:
a split softmax would change the sums.

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

Batch invariance: a program owns its row's heads and walks the row's blocks in order; nothing
depends on T or on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, dot_bf16, exp_f32, sm_count, to_bf16

BLOCK_L = 64  # listed entries per online-softmax step: the twin's block
HEAD_BLOCKS = {16: 4, 32: 8}  # heads per program (the narrow side of the products) -> warps
NUM_STAGES = 3  # KV blocks in flight: 3 x 64 KB of shared memory at D = 512 (168 KB with q and p at 32 heads)
EMPTY_MAX = -1e30  # the twin's start of the running max: finite, so exp(old - new) is 0 on the first block


@triton.jit
def _sparse_attention_kernel(q_ptr, pool_ptr, index_ptr, valid_ptr, sink_ptr, out_ptr, scale, H, D, L,
                             stride_qt, stride_qh, stride_pool, stride_it, stride_vt, stride_ot, stride_oh,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                             EMPTY_MAX: tl.constexpr, INTERPRETED: tl.constexpr):
    head_blocks = tl.cdiv(H, BLOCK_H)
    row = (tl.program_id(0) // head_blocks).to(tl.int64)
    offs_h = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, BLOCK_L)
    h_mask = offs_h < H
    d_mask = offs_d < D
    q_t = tl.load(q_ptr + row * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
                  mask=d_mask[:, None] & h_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_H]
    index_ptr += row * stride_it
    valid_ptr += row * stride_vt
    # the blocks from the first valid entry's to the last's (blocks of holes change nothing)
    first = L
    last = -1
    for start in range(0, L, BLOCK_L):
        cols = start + offs_l
        ok = tl.load(valid_ptr + cols, mask=cols < L, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(ok, cols, L), axis=0))
        last = tl.maximum(last, tl.max(tl.where(ok, cols, -1), axis=0))
    acc = tl.zeros((BLOCK_D, BLOCK_H), dtype=tl.float32)  # the output, transposed
    sum_exp = tl.zeros((BLOCK_H,), dtype=tl.float32)
    running_max = tl.full((BLOCK_H,), EMPTY_MAX, dtype=tl.float32)
    for start in range(first - first % BLOCK_L, last + 1, BLOCK_L):
        cols = start + offs_l
        ok = tl.load(valid_ptr + cols, mask=cols < L, other=0) != 0
        entry = tl.load(index_ptr + cols, mask=ok, other=0).to(tl.int64)
        kv = tl.load(pool_ptr + entry[:, None] * stride_pool + offs_d[None, :],
                     mask=ok[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_L, BLOCK_D]; holes: zeros, not read
        scores = tl.where(ok[:, None], dot_bf16(kv, q_t, INTERPRETED), -float("inf")) * scale  # [BLOCK_L, BLOCK_H]
        block_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = exp_f32(running_max - block_max, INTERPRETED)
        p = exp_f32(scores - block_max[None, :], INTERPRETED)
        sum_exp = sum_exp * rescale + tl.sum(p, axis=0)
        acc = acc * rescale[None, :] + dot_bf16(tl.trans(kv), to_bf16(p, INTERPRETED), INTERPRETED)
        running_max = block_max
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    # no valid entry (the running max still at its start): the twin's 0 / inf; here 0 / 1, exact zeros
    # as well, without overflowing exp(sink + 1e30)
    seen = running_max > EMPTY_MAX
    sum_exp = sum_exp + exp_f32(tl.where(seen, sink - running_max, 0.0), INTERPRETED)
    out = tl.div_rn(acc, sum_exp[None, :])
    tl.store(out_ptr + row * stride_ot + offs_h[None, :] * stride_oh + offs_d[:, None], to_bf16(out, INTERPRETED),
             mask=d_mask[:, None] & h_mask[None, :])


def sparse_attention(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                     sink: torch.Tensor, scale: float, block_h: int | None = None) -> torch.Tensor:
    """q ``[T, H, D]`` bf16 over each row's listed KV rows ``pool[index[t]]`` (``pool [R, D]`` bf16,
    ``index [T, L]`` integer, ``valid [T, L]`` bool, False: a hole), with ``sink [H]`` fp32 ->
    ``[T, H, D]`` bf16 (see the module docstring). ``block_h``: heads per program, a key of
    ``HEAD_BLOCKS``; by default 16 while that makes at most one wave of programs, else 32."""
    t, h, d = q.shape
    length = index.shape[1]
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    if t == 0 or h == 0 or d == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if pool.stride(-1) != 1:
        pool = pool.contiguous()
    index = index.to(torch.int32).contiguous()
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    valid = valid.view(torch.uint8)  # same bytes; a bool pointer is awkward in a kernel
    sink = sink.float().contiguous()
    if block_h is None:
        block_h = 16 if t * triton.cdiv(h, 16) <= sm_count(q.device) else 32
    grid = (t * triton.cdiv(h, block_h),)  # a row's head blocks side by side: its KV rows are read together
    _sparse_attention_kernel[grid](
        q, pool, index, valid, sink, out, float(scale), h, d, length,
        q.stride(0), q.stride(1), pool.stride(0), index.stride(0), valid.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_L=BLOCK_L, EMPTY_MAX=EMPTY_MAX,
        INTERPRETED=INTERPRETED, num_warps=HEAD_BLOCKS[block_h], num_stages=NUM_STAGES, enable_fp_fusion=False)
    return out
