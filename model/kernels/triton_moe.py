"""Triton kernels of the routed experts (twin: ``ReferenceKernels.expert_outputs``).

One MoE layer's routed experts in four steps, with no host synchronisation:

1. ``act_quant_bf16``: each token's FP8 round trip per 32 (the reference's activation
   quantization, exact in bf16), once per token whatever its number of experts.
2. ``align_pairs``: (token, expert) pairs are sorted by expert and the sorted list is cut into
   blocks of ``block_m`` pairs that never straddle two experts (one launch of
   ``triton_align_pairs`` up to its ``MAX_PAIRS``, torch ops on the device above). The grid is
   sized from the shapes alone (``ceil(P / block_m) + min(E, P)`` blocks at most); blocks past the
   last real one exit at once.
3. ``_gate_up_kernel``: per (block, tile of the intermediate dimension), the block's token rows
   (gathered) times the expert's ``w1`` and ``w3``; the epilogue rounds both to bf16 as the
   reference's projections do, applies the clamped SwiGLU and the routing weight, rounds to bf16,
   and applies the down projection's FP8 round trip per 32 (the groups lie inside one tile),
   writing bf16 rows in sorted order.
4. ``_down_kernel``: per (block, tile of the hidden dimension), those rows times the expert's
   ``w2``; each row is written to its pair's place in the output.

An expert's last block is rarely full: with uniform routing an expert's pair count spreads around
its mean, so at 128 tokens per block half of an 8K-token prefill's experts need a second block that
holds a few rows (68% of the blocks' rows in use). Both kernels therefore narrow a block's token tile
at run time to the rows it holds (a quarter, a half or all of ``BLOCK_T``, at least 16 tokens): a
block of 6 rows multiplies a 16-token tile, not a 128-token one. The blocks and their rows stay where
they are; only the tensor cores' narrow side shrinks, as it does between the table's configs (16 to
128 tokens wide, whose rows come out bit for bit the same: ``test_triton_kernels_gpu.py``). On one
H100 the experts' layer at 8,192 tokens took 8.85 instead of 10.18 ms (docs/benchmarks-log.md).

Layout on the tensor cores (as ``triton_decode_mm``): the expert's weight rows fill the 64-row side
and a block's tokens (16-64) the narrow side, so the few tokens an expert gets in a decode step
waste no instruction rows. Each K step of ``BLOCK_K`` columns expands the weight tile to bf16 with
its scales applied (e4m3 or e2m1 times a power of two: exact), so every product is exact and only
the order of the fp32 sums differs from the reference's per-32-block order. FP4 experts are read in
the fragment layout the Triton backend loads them in (``fp4_fragments.py``: a shift, a mask and a
bf16 multiply per pair of values, ``triton_weight_tiles.fragment_tile``), or, when a checkpoint's
scales or shapes do not allow it, in the checkpoint's rows (``weight_rows``: fp16 through a few bit
operations of inline PTX, then fp32). Wide steps let the compiler stream the weight tiles into
shared memory several steps ahead (``num_stages``).

Batch invariance: a pair's result depends only on its own row: one fixed ``BLOCK_K`` (so K is summed
in the same steps by every config), no split-K, one instruction shape for every config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_align_pairs
from .tile_configs import moe_config
from .triton_common import INTERPRETED, quantize_groups_of_32, to_bf16
from .triton_scaled_mm import act_quant_bf16
from .triton_weight_tiles import FP4_FRAGMENTS, format_code, fragment_offsets, fragment_tile, weight_rows
from .weights import ExpertWeights

BLOCK_K = 128  # K columns per step, fixed for batch invariance (the experts' widths are multiples of 32)
MIN_WIDTH = tl.constexpr(16)  # the narrowest token tile of a block's last rows (the tensor cores' narrow side)


@triton.jit
def _block_rows(sorted_pair_ptr, first, block_index, count, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr):
    """(row mask, pair ids) of the first ``WIDTH`` rows of block ``block_index`` of one expert's pairs
    (``count`` of them, listed from ``sorted_pair_ptr + first``)."""
    rows = block_index * BLOCK_T + tl.arange(0, WIDTH)
    row_mask = rows < count
    return row_mask, tl.load(sorted_pair_ptr + first + rows, mask=row_mask, other=0)


@triton.jit
def _block_of(block_expert_ptr, block_index_ptr, expert_start_ptr, expert_count_ptr, pid_b, BLOCK_T: tl.constexpr):
    """(expert, block index within the expert, the expert's first sorted pair, its pair count, the
    block's rows in use) of block ``pid_b``; expert < 0: no work."""
    expert = tl.load(block_expert_ptr + pid_b)
    safe = tl.maximum(expert, 0)
    block_index = tl.load(block_index_ptr + pid_b)
    count = tl.where(expert >= 0, tl.load(expert_count_ptr + safe), 0)
    rows_in_use = tl.minimum(count - block_index * BLOCK_T, BLOCK_T)
    return expert, block_index, tl.load(expert_start_ptr + safe), count, rows_in_use


@triton.jit
def _narrowest_tile(block_rows_fn: tl.constexpr, args, rows_in_use, B_FMT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``block_rows_fn(*args, ...)`` (``_gate_up_rows`` or ``_down_rows``) with the narrowest token tile
    that holds a block's rows in use: a quarter, a half or all of ``BLOCK_T`` when that is at least
    4 x ``MIN_WIDTH`` tokens, else all of it."""
    if BLOCK_T >= 4 * MIN_WIDTH:
        if rows_in_use <= BLOCK_T // 4:
            block_rows_fn(*args, B_FMT, BLOCK_T, BLOCK_T // 4, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
        elif rows_in_use <= BLOCK_T // 2:
            block_rows_fn(*args, B_FMT, BLOCK_T, BLOCK_T // 2, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
        else:
            block_rows_fn(*args, B_FMT, BLOCK_T, BLOCK_T, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
    else:
        block_rows_fn(*args, B_FMT, BLOCK_T, BLOCK_T, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)


@triton.jit
def _dot(acc, w, a, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
        return tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, a, acc)


@triton.jit
def _expert_tile(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, words, scales, groups, B_FMT: tl.constexpr,
                 BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """bf16 ``[BLOCK_W, BLOCK_K]`` of an expert's weight at columns ``k0..``: rows ``offs_w`` of the
    checkpoint layout, or, in the fragment layout, the tile whose first word and scale ``w_ptr`` and
    ``s_ptr`` point at for ``k0 = 0`` (``_tile_start``)."""
    if B_FMT == FP4_FRAGMENTS:
        return fragment_tile(w_ptr + k0 * 8, s_ptr + k0 // 2, words, scales, groups, BLOCK_W, BLOCK_K, INTERPRETED)
    return weight_rows(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, B_FMT, BLOCK_W, BLOCK_K, EVEN_K,
                       INTERPRETED)


@triton.jit
def _tile_start(pid_w, K, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr):
    """(byte offset of the program's first word, of its first scale) in one expert's fragment-layout
    matrix: row group ``pid_w * BLOCK_W / 16`` holds ``K / 64 * 512`` bytes of words and ``K / 2`` of
    scales (0, 0 in the checkpoint layout, which indexes rows)."""
    first = (pid_w * (BLOCK_W // 16)).to(tl.int64)
    if B_FMT != FP4_FRAGMENTS:
        first = first * 0
    return first * (K * 8), first * (K // 2)


@triton.jit
def _gate_up_rows(x_ptr, pair_token_ptr, pair_weight_ptr, sorted_pair_ptr, first, block_index, count, pid_w, pid_b,
                  w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, D, INTER, stride_x, stride_wn, stride_sn, stride_h, limit,
                  B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gate/up product of the first ``WIDTH`` rows of a block, its epilogue and its store."""
    row_mask, pairs = _block_rows(sorted_pair_ptr, first, block_index, count, BLOCK_T, WIDTH)
    tokens = tl.load(pair_token_ptr + pairs, mask=row_mask, other=0).to(tl.int64)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    words, scales = fragment_offsets(D, BLOCK_W, BLOCK_K)
    groups = INTER // 16 - pid_w * (BLOCK_W // 16)
    gate = tl.zeros((BLOCK_W, WIDTH), dtype=tl.float32)
    up = tl.zeros((BLOCK_W, WIDTH), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < D), other=0.0)  # [WIDTH, BLOCK_K]
        w1 = _expert_tile(w1_ptr, s1_ptr, offs_w, k0, INTER, D, stride_wn, stride_sn, words, scales, groups, B_FMT,
                          BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
        gate = _dot(gate, w1, tl.trans(a), INTERPRETED)
        w3 = _expert_tile(w3_ptr, s3_ptr, offs_w, k0, INTER, D, stride_wn, stride_sn, words, scales, groups, B_FMT,
                          BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
        up = _dot(up, w3, tl.trans(a), INTERPRETED)
    weight = tl.load(pair_weight_ptr + pairs, mask=row_mask, other=0.0)
    round_trip = hidden_round_trip(gate, up, weight, limit, WIDTH, BLOCK_W, INTERPRETED)
    rows = (pid_b * BLOCK_T + tl.arange(0, WIDTH)).to(tl.int64)
    tl.store(h_ptr + rows[:, None] * stride_h + offs_w[None, :], round_trip.to(tl.bfloat16),  # exact
             mask=row_mask[:, None] & (offs_w[None, :] < INTER))


@triton.jit
def _gate_up_kernel(x_ptr, pair_token_ptr, pair_weight_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr,
                    block_expert_ptr, block_index_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                    D, INTER, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, limit,
                    B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_w, pid_b = tl.program_id(0), tl.program_id(1)
    expert, block_index, first, count, rows_in_use = _block_of(block_expert_ptr, block_index_ptr, expert_start_ptr,
                                                               expert_count_ptr, pid_b, BLOCK_T)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    w_start, s_start = _tile_start(pid_w, D, B_FMT, BLOCK_W)
    w1_ptr += e * stride_we + w_start
    w3_ptr += e * stride_we + w_start
    s1_ptr += e * stride_se + s_start
    s3_ptr += e * stride_se + s_start
    args = (x_ptr, pair_token_ptr, pair_weight_ptr, sorted_pair_ptr, first, block_index, count, pid_w, pid_b,
            w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, D, INTER, stride_x, stride_wn, stride_sn, stride_h, limit)
    _narrowest_tile(_gate_up_rows, args, rows_in_use, B_FMT, BLOCK_T, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)


@triton.jit
def hidden_round_trip(gate, up, weight, limit, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """fp32 sums of ``w1`` and ``w3`` ``[BLOCK_W features, BLOCK_T pairs]`` and the pairs' routing
    weights -> the down projection's input ``[BLOCK_T, BLOCK_W]`` (fp32, exact in bf16): both rounded to
    bf16 as the reference's projections are, the clamped SwiGLU times the routing weight rounded to
    bf16, then its FP8 round trip per 32 features (``BLOCK_W`` whole groups)."""
    gate = to_bf16(gate, INTERPRETED).to(tl.float32)  # the reference's w1(x) and w3(x) are bf16
    up = to_bf16(up, INTERPRETED).to(tl.float32)
    if limit > 0:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    hidden = to_bf16(weight[None, :] * (gate / (1.0 + tl.exp(-gate)) * up), INTERPRETED).to(tl.float32)
    q, scale = quantize_groups_of_32(tl.trans(hidden), BLOCK_T, BLOCK_W)  # [pairs, features]
    return tl.reshape(tl.reshape(q, (BLOCK_T, BLOCK_W // 32, 32)) * scale[:, :, None], (BLOCK_T, BLOCK_W))


@triton.jit
def _down_rows(h_ptr, out_ptr, sorted_pair_ptr, first, block_index, count, pid_w, pid_b, w2_ptr, s2_ptr, INTER, D,
               stride_h, stride_out, stride_wn, stride_sn, B_FMT: tl.constexpr, BLOCK_T: tl.constexpr,
               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """The down projection of the first ``WIDTH`` rows of a block, each written to its pair's row."""
    row_mask, pairs = _block_rows(sorted_pair_ptr, first, block_index, count, BLOCK_T, WIDTH)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    rows = (pid_b * BLOCK_T + tl.arange(0, WIDTH)).to(tl.int64)
    words, scales = fragment_offsets(INTER, BLOCK_W, BLOCK_K)
    groups = D // 16 - pid_w * (BLOCK_W // 16)
    acc = tl.zeros((BLOCK_W, WIDTH), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + rows[:, None] * stride_h + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < INTER), other=0.0)
        w2 = _expert_tile(w2_ptr, s2_ptr, offs_w, k0, D, INTER, stride_wn, stride_sn, words, scales, groups, B_FMT,
                          BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)
        acc = _dot(acc, w2, tl.trans(a), INTERPRETED)
    tl.store(out_ptr + pairs[None, :].to(tl.int64) * stride_out + offs_w[:, None], to_bf16(acc, INTERPRETED),
             mask=row_mask[None, :] & (offs_w[:, None] < D))


@triton.jit
def _down_kernel(h_ptr, out_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr, block_expert_ptr,
                 block_index_ptr, w2_ptr, s2_ptr, INTER, D, stride_h, stride_out, stride_we, stride_wn,
                 stride_se, stride_sn, B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_w, pid_b = tl.program_id(0), tl.program_id(1)
    expert, block_index, first, count, rows_in_use = _block_of(block_expert_ptr, block_index_ptr, expert_start_ptr,
                                                               expert_count_ptr, pid_b, BLOCK_T)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    w_start, s_start = _tile_start(pid_w, INTER, B_FMT, BLOCK_W)
    w2_ptr += e * stride_we + w_start
    s2_ptr += e * stride_se + s_start
    args = (h_ptr, out_ptr, sorted_pair_ptr, first, block_index, count, pid_w, pid_b, w2_ptr, s2_ptr, INTER, D,
            stride_h, stride_out, stride_wn, stride_sn)
    _narrowest_tile(_down_rows, args, rows_in_use, B_FMT, BLOCK_T, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)


def align_pairs(pair_expert: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False,
                zero_rows: torch.Tensor | None = None):
    """``align_pairs_torch``'s result: in one launch for the few pairs of a decode step
    (``triton_align_pairs``; ``pdl``: with programmatic dependent launch), else by torch ops that sort
    on every SM. ``zero_rows``: a ``[P, D]`` output whose rows of pairs of no local expert are set to
    zero (by the launch, or a memset of all of it after the torch ops)."""
    if pair_expert.shape[0] <= triton_align_pairs.MAX_PAIRS:
        return triton_align_pairs.align_pairs(pair_expert, num_experts, block_m, pdl, zero_rows)
    if zero_rows is not None:
        zero_rows.zero_()
    return align_pairs_torch(pair_expert, num_experts, block_m)


def align_pairs_torch(pair_expert: torch.Tensor, num_experts: int, block_m: int):
    """Sort pairs by expert and cut them into per-expert blocks, on the device, without a sync.

    Returns (sorted_pair, expert_start, expert_count, block_expert, block_index): ``sorted_pair``
    lists pair ids expert by expert (pair order within one expert); block ``b`` covers rows
    ``block_index[b] * block_m ..`` of expert ``block_expert[b]`` (-1: an unused block).
    Pairs whose expert is outside ``[0, num_experts)`` belong to no block.
    """
    p = pair_expert.shape[0]
    device = pair_expert.device
    valid = (pair_expert >= 0) & (pair_expert < num_experts)
    key = torch.where(valid, pair_expert, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would read the max back to the host
    counts = counts[:num_experts]
    sorted_pair = torch.argsort(key, stable=True)
    expert_start = torch.cumsum(counts, 0) - counts
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    num_blocks = triton.cdiv(p, block_m) + min(num_experts, p)  # an upper bound known without a sync
    b = torch.arange(num_blocks, device=device)
    block_expert = torch.searchsorted(block_end, b, right=True)
    in_use = block_expert < num_experts
    block_expert = block_expert.clamp(max=num_experts - 1)
    block_index = b - (block_end - blocks)[block_expert]
    block_expert = torch.where(in_use, block_expert, -1)
    return sorted_pair, expert_start, counts, block_expert, block_index


def fused_experts(x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor,
                  experts: ExpertWeights) -> torch.Tensor:
    """Routed expert outputs ``[P, D]`` bf16 of bf16 token rows ``x [N, D]``."""
    p, d = pair_token.shape[0], x.shape[1]
    out = torch.empty(p, d, dtype=torch.bfloat16, device=x.device)  # the pair sort zeroes other ranks' rows
    if p == 0:
        return out
    x = act_quant_bf16(x.contiguous())  # each token once, whatever its number of experts
    num_experts, inter = experts.num_experts, experts.w1.out_features
    cfg = moe_config(p / num_experts)
    sorted_pair, start, count, block_expert, block_index = align_pairs(pair_expert, num_experts, cfg.block_m,
                                                                       zero_rows=out)
    num_blocks = block_expert.shape[0]
    hidden = torch.empty(num_blocks * cfg.block_m, inter, dtype=torch.bfloat16, device=x.device)
    fmt = format_code(experts.w1)
    w1, w3, w2 = (w.values.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    s1, s3, s2 = (w.scales.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    common = dict(B_FMT=fmt, BLOCK_T=cfg.block_m, BLOCK_W=cfg.block_n, BLOCK_K=BLOCK_K,
                  EVEN_K=d % BLOCK_K == 0 and inter % BLOCK_K == 0, INTERPRETED=INTERPRETED,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_kernel[(triton.cdiv(inter, cfg.block_n), num_blocks)](
        x, pair_token, pair_weight, sorted_pair, start, count, block_expert, block_index,
        w1, s1, w3, s3, hidden, d, inter, x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        hidden.stride(0), float(experts.swiglu_limit), **common)
    _down_kernel[(triton.cdiv(d, cfg.block_n), num_blocks)](
        hidden, out, sorted_pair, start, count, block_expert, block_index, w2, s2, inter, d,
        hidden.stride(0), out.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), **common)
    return out
