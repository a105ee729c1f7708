"""Decode form of the bf16-operand products: a few tokens, the weight streamed by many programs.

``decode_mm`` computes what ``triton_bf16_mm.bf16_mm`` computes (the FP8 linears, the grouped
``wo_a``, the bf16 head; same layouts, same twins in ``reference.py``) for the small M of decode
steps, where the weight's bytes are the whole cost. Three changes make it stream the weight near the
memory bandwidth instead of waiting on one small tile at a time:

* operands swapped (``C^T = W a^T``): weight rows fill the tensor cores' 64-row side, the tokens
  (16 to 64, padded) the narrow side, so no instruction row is wasted on absent tokens;
* wide K steps (``block_k`` 128-256 columns: 8-32 KB of weight per step per program, several steps
  in flight);
* split-K: K is cut into ``splits`` equal ranges so that there are a few programs per SM even for
  the narrow matrices (``wkv`` has 8 tiles of 64 rows). Each program writes its fp32 partial sums;
  ``_sum_splits_kernel`` adds them in split order (deterministic: the same inputs give the same
  bits on every run) and rounds once. One split writes the output directly.

For the FP8 linears the activation's FP8 round trip per 32 (``act_quant_bf16``, exact) is done in
the prologue of each K step instead of in a separate launch.

Not batch invariant: the split, and the summation order it implies, depend on the shape, and the
prefill form (``bf16_mm``) sums K in one pass. ``TritonKernels(batch_invariant=True)`` therefore
uses ``bf16_mm`` at every M.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import DecodeConfig, decode_mm_config
from .triton_common import INTERPRETED, quantize_groups_of_32, sm_count, to_bf16
from .triton_weight_tiles import FORMAT_CODES, weight_rows

# the decode form takes M <= this (one token tile); at M = 256 it measured slower than the
# prefill form (the weight re-read per 64-token tile costs more than the split saves)
MAX_TOKENS = 64


@triton.jit
def _fp8_round_trip(a, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 ``[BLOCK_T, BLOCK_K]`` -> its FP8 round trip per 32 along K, in bf16 (exact)."""
    q, scale = quantize_groups_of_32(a.to(tl.float32), BLOCK_T, BLOCK_K)
    y = tl.reshape(q, (BLOCK_T, BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.reshape(y, (BLOCK_T, BLOCK_K)).to(tl.bfloat16)  # e4m3 times a power of two: exact


@triton.jit
def _decode_mm_kernel(a_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                      stride_am, stride_ag, stride_wn, stride_wg, stride_sn, stride_sg, stride_os, stride_om,
                      B_FMT: tl.constexpr, QUANT_A: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, OUT_F32: tl.constexpr,
                      EXACT_DOT: tl.constexpr):
    pid_w, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # output features (weight rows of this group)
    offs_t = tl.arange(0, BLOCK_T)  # tokens
    a_ptr += group * stride_ag
    w_ptr += group * stride_wg
    s_ptr += group * stride_sg
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_t[:, None] * stride_am + offs_k[None, :],
                    mask=(offs_t[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if QUANT_A:
            a = _fp8_round_trip(a, BLOCK_T, BLOCK_K)
        w = weight_rows(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, B_FMT, BLOCK_W, BLOCK_K,
                        False, EXACT_DOT)
        if EXACT_DOT:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
            acc = tl.dot(w.to(tl.float32), tl.trans(a).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(a), acc)
    cols = group * N + offs_w  # the output's columns: groups side by side
    mask = (offs_t[None, :] < M) & (offs_w[:, None] < N)
    out_ptr += split * stride_os + offs_t[None, :] * stride_om + cols[:, None]
    if PARTIAL or OUT_F32:
        tl.store(out_ptr, acc, mask=mask)
    else:
        tl.store(out_ptr, to_bf16(acc, EXACT_DOT), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, OUT_F32: tl.constexpr, BLOCK: tl.constexpr,
                       EXACT_DOT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):  # split order: the same bits on every run
        total += tl.load(part_ptr + split * numel + offs, mask=mask, other=0.0)
    if OUT_F32:
        tl.store(out_ptr + offs, total, mask=mask)
    else:
        tl.store(out_ptr + offs, to_bf16(total, EXACT_DOT), mask=mask)


SHARED_MEMORY_BYTES = 200 * 1024  # of the 227 KiB an H100/H200 block may use: room for the compiler's own


def fit_shared_memory(cfg: DecodeConfig, weight_bytes: int, block_t: int) -> DecodeConfig:
    """``cfg`` with ``block_k`` halved until the pipeline's buffers (``num_stages`` weight and activation
    tiles) fit in shared memory: the tables are tuned for FP8 weights, the bf16 head takes twice the bytes."""
    while cfg.block_k > 64 and cfg.num_stages * cfg.block_k * (cfg.block_w * weight_bytes + block_t * 2) > SHARED_MEMORY_BYTES:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def split_count(cfg: DecodeConfig, n: int, k: int, groups: int, sms: int) -> tuple[int, int]:
    """(splits, K columns per split): enough programs for ``cfg.programs_per_sm`` per SM, each
    split a whole number of ``block_k`` steps."""
    tiles = triton.cdiv(n, cfg.block_w) * groups
    steps = triton.cdiv(k, cfg.block_k)
    splits = max(1, min(steps, triton.cdiv(cfg.programs_per_sm * sms, tiles), cfg.max_splits))
    steps_per_split = triton.cdiv(steps, splits)
    return triton.cdiv(steps, steps_per_split), steps_per_split * cfg.block_k


def decode_mm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, fmt: WeightFormat,
              groups: int = 1, out_dtype: torch.dtype = torch.bfloat16, quantize_activation: bool = False) -> torch.Tensor:
    """``a [M, G*K]`` bf16 (M <= ``MAX_TOKENS``; group g reads columns g*K..) times ``W [G*N, K]``
    (FP8, or BF16 with ``scales`` None) -> ``[M, G*N]`` in ``out_dtype``. ``quantize_activation``:
    multiply ``a``'s FP8 round trip per 32 (what ``act_quant_bf16`` gives) instead of ``a``."""
    m = a.shape[0]
    k = a.shape[1] // groups
    n = values.shape[0] // groups
    if m > MAX_TOKENS:
        raise ValueError(f"decode_mm takes at most {MAX_TOKENS} rows, got {m}")
    out = torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    block_t = max(16, triton.next_power_of_2(m))
    cfg = fit_shared_memory(decode_mm_config(m), values.element_size(), block_t)
    splits, k_per_split = split_count(cfg, n, k, groups, sm_count(a.device))
    if fmt is WeightFormat.BF16:
        w, s, scale_rows_per_group = values, values, 0
    else:
        w, s = values.view(torch.uint8), scales.view(torch.uint8)
        scale_rows_per_group = n // 32
    partial = splits > 1
    target = torch.empty(splits, m, groups * n, dtype=torch.float32, device=a.device) if partial else out
    _decode_mm_kernel[(triton.cdiv(n, cfg.block_w), splits, groups)](
        a, w, s, target, m, n, k, k_per_split,
        a.stride(0), k, w.stride(0), n * w.stride(0), s.stride(0), scale_rows_per_group * s.stride(0),
        m * groups * n if partial else 0, groups * n,
        B_FMT=FORMAT_CODES[fmt], QUANT_A=quantize_activation, BLOCK_T=block_t, BLOCK_W=cfg.block_w,
        BLOCK_K=cfg.block_k, PARTIAL=partial, OUT_F32=out_dtype == torch.float32, EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if partial:
        numel, block = out.numel(), 1024
        _sum_splits_kernel[(triton.cdiv(numel, block),)](target, out, numel, SPLITS=splits,
                                                         OUT_F32=out_dtype == torch.float32, BLOCK=block,
                                                         EXACT_DOT=INTERPRETED, num_warps=4)
    return out
