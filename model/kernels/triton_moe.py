"""Triton kernels of the routed experts (twin: ``reference.py::ReferenceKernels.expert_outputs``).

One MoE layer's routed experts in three steps, with no host synchronisation:

1. ``align_pairs`` (torch ops on the device): (token, expert) pairs are sorted by expert, and the
   sorted list is cut into blocks of ``BLOCK_M`` rows that never straddle two experts. The grid
   size is fixed from the shapes alone (``ceil(P / BLOCK_M) + min(E, P)`` blocks at most); blocks
   past the last real one exit at once.
2. ``_gate_up_kernel``: per (block, column tile), the block's token rows (gathered, FP8 round trip
   already applied) times the expert's ``w1`` and ``w3`` tiles (expanded in registers from FP4/FP8,
   see ``triton_gemm.weight_tile``), both accumulated in fp32; the epilogue rounds both to bf16 as
   the reference's projections do, applies the clamped SwiGLU and the routing weight, rounds to
   bf16 and applies the FP8 round trip that the down projection's input takes (groups of 32 lie
   inside one column tile), and writes the hidden rows in sorted order.
3. ``_down_kernel``: per (block, column tile), the hidden rows times the expert's ``w2``; each row
   is written to its pair's place in the output.

A pair's computation depends only on its own row (fixed K order, no split-K): batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tile_configs import moe_config
from .triton_gemm import BLOCK_K, FORMAT_CODES, INTERPRETED, qdq_groups_of_32, to_bf16, weight_tile
from .weights import ExpertWeights


@triton.jit
def _block_rows(block_expert_ptr, block_index_ptr, expert_start_ptr, expert_count_ptr, sorted_pair_ptr, pid_b,
                BLOCK_M: tl.constexpr):
    """(expert, row mask, pair ids) of one block of the sorted pair list; expert < 0: no work."""
    expert = tl.load(block_expert_ptr + pid_b)
    safe = tl.maximum(expert, 0)
    rows = tl.load(block_index_ptr + pid_b) * BLOCK_M + tl.arange(0, BLOCK_M)
    count = tl.where(expert >= 0, tl.load(expert_count_ptr + safe), 0)
    row_mask = rows < count
    pairs = tl.load(sorted_pair_ptr + tl.load(expert_start_ptr + safe) + rows, mask=row_mask, other=0)
    return expert, row_mask, pairs


@triton.jit
def _gate_up_kernel(x_ptr, pair_token_ptr, pair_weight_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr,
                    block_expert_ptr, block_index_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                    D, INTER, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, limit,
                    B_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    pid_n, pid_b = tl.program_id(0), tl.program_id(1)
    expert, row_mask, pairs = _block_rows(block_expert_ptr, block_index_ptr, expert_start_ptr, expert_count_ptr,
                                          sorted_pair_ptr, pid_b, BLOCK_M)
    if expert < 0:
        return
    tokens = tl.load(pair_token_ptr + pairs, mask=row_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w1_ptr += expert.to(tl.int64) * stride_we
    w3_ptr += expert.to(tl.int64) * stride_we
    s1_ptr += expert.to(tl.int64) * stride_se
    s3_ptr += expert.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < D), other=0.0)
        b1 = weight_tile(w1_ptr, s1_ptr, k0, offs_n, INTER, D, stride_wn, stride_sn, B_FMT, BLOCK_K)
        b3 = weight_tile(w3_ptr, s3_ptr, k0, offs_n, INTER, D, stride_wn, stride_sn, B_FMT, BLOCK_K)
        if INTERPRETED:
            gate = tl.dot(a.to(tl.float32), b1.to(tl.float32), gate, input_precision="ieee")
            up = tl.dot(a.to(tl.float32), b3.to(tl.float32), up, input_precision="ieee")
        else:
            gate = tl.dot(a, b1, gate)
            up = tl.dot(a, b3, up)
    gate = to_bf16(gate, INTERPRETED).to(tl.float32)
    up = to_bf16(up, INTERPRETED).to(tl.float32)
    if limit > 0:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    weight = tl.load(pair_weight_ptr + pairs, mask=row_mask, other=0.0)
    hidden = to_bf16(weight[:, None] * (gate / (1.0 + tl.exp(-gate)) * up), INTERPRETED).to(tl.float32)
    hidden = qdq_groups_of_32(hidden, BLOCK_M, BLOCK_N)
    rows = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_n[None, :], hidden.to(tl.bfloat16),
             mask=row_mask[:, None] & (offs_n[None, :] < INTER))


@triton.jit
def _down_kernel(h_ptr, out_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr, block_expert_ptr,
                 block_index_ptr, w2_ptr, s2_ptr, INTER, D, stride_h, stride_out, stride_we, stride_wn, stride_se,
                 stride_sn, B_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_n, pid_b = tl.program_id(0), tl.program_id(1)
    expert, row_mask, pairs = _block_rows(block_expert_ptr, block_index_ptr, expert_start_ptr, expert_count_ptr,
                                          sorted_pair_ptr, pid_b, BLOCK_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    w2_ptr += expert.to(tl.int64) * stride_we
    s2_ptr += expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < INTER), other=0.0)
        b = weight_tile(w2_ptr, s2_ptr, k0, offs_n, D, INTER, stride_wn, stride_sn, B_FMT, BLOCK_K)
        if INTERPRETED:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :], to_bf16(acc, INTERPRETED),
             mask=row_mask[:, None] & (offs_n[None, :] < D))


def align_pairs(pair_expert: torch.Tensor, num_experts: int, block_m: int):
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


def fused_experts(x_quantized: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor,
                  pair_weight: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """Routed expert outputs ``[P, D]`` bf16; ``x_quantized`` is the FP8 round trip of the token rows."""
    p, d = pair_token.shape[0], x_quantized.shape[1]
    out = torch.zeros(p, d, dtype=torch.bfloat16, device=x_quantized.device)
    if p == 0:
        return out
    num_experts, inter = experts.num_experts, experts.w1.out_features
    cfg = moe_config(p / num_experts)
    sorted_pair, start, count, block_expert, block_index = align_pairs(pair_expert, num_experts, cfg.block_m)
    num_blocks = block_expert.shape[0]
    hidden = torch.empty(num_blocks * cfg.block_m, inter, dtype=torch.bfloat16, device=x_quantized.device)
    fmt = FORMAT_CODES[experts.w1.fmt]
    w1, w3, w2 = (w.values.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    s1, s3, s2 = (w.scales.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    common = dict(B_FMT=fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, INTERPRETED=INTERPRETED,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_kernel[(triton.cdiv(inter, cfg.block_n), num_blocks)](
        x_quantized, pair_token, pair_weight, sorted_pair, start, count, block_expert, block_index,
        w1, s1, w3, s3, hidden, d, inter, x_quantized.stride(0), w1.stride(0), w1.stride(1), s1.stride(0),
        s1.stride(1), hidden.stride(0), float(experts.swiglu_limit), **common)
    _down_kernel[(triton.cdiv(d, cfg.block_n), num_blocks)](
        hidden, out, sorted_pair, start, count, block_expert, block_index, w2, s2, inter, d, hidden.stride(0),
        out.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), **common)
    return out
