"""Triton kernel of the products on bf16 operands: the FP8 linears, ``wo_a`` and the head.

``bf16_mm(a, W)``: ``a [M, G*K]`` bf16 times ``W [G*N, K]``, where W is FP8 (e4m3 with one UE8M0
scale per 32x32 tile, expanded in registers to bf16: exact) or plain bf16. Three uses:

* the FP8 linears (twin ``ReferenceKernels.quantized_linear``): ``a`` is the activation's FP8
  round trip in bf16 (``triton_scaled_mm.act_quant_bf16``, exact), so every product is exact;
* the grouped output projection ``wo_a`` (twin ``ReferenceKernels.grouped_dequantized_linear``):
  a leading group axis runs the 8 weight slices in one launch, on the bf16 activation;
* the head, with fp32 output (twin ``ReferenceKernels.logits``: the reference multiplies fp32 copies
  of bf16 values, the same exact products).

For the FP8 linears this kernel measured faster than ``triton_scaled_mm`` on one H200 at every M
(``docs/benchmarks-log.md``): the weight tile is expanded once per 64 columns of K, against a scaled
accumulation per 32-block there. Products accumulate in fp32 on the tensor cores; the reference's sums differ only in
order. Batch invariance: one program owns whole output elements and walks K from 0 in fixed steps
of ``BLOCK_K`` (no split-K); every tile config uses the same instruction shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import bf16_mm_config
from .triton_common import INTERPRETED, to_bf16
from .triton_weight_tiles import FORMAT_CODES

BLOCK_K = 64  # two scale blocks of 32 per step; fixed so every config sums K in the same steps


@triton.jit
def weight_tile(w_ptr, s_ptr, k0, offs_n, N, K, stride_wn, stride_sn, B_FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The bf16 tile ``W[offs_n, k0:k0+64]^T`` ([64, BLOCK_N]) of a stored weight, scales applied.

    FP8: ``k0`` is a multiple of 64, so the tile spans two 32x32 scale tiles along K.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    if B_FMT == 2:  # a plain bf16 weight
        tile = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0)
    else:
        raw = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0)
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_row = offs_n // 32  # one scale per 32x32 tile
        first_block = k0 // 32
        n_mask = offs_n < N
        lo = tl.load(s_ptr + scale_row * stride_sn + first_block, mask=n_mask, other=0).to(tl.int32)
        hi = tl.load(s_ptr + scale_row * stride_sn + first_block + 1,
                     mask=n_mask & ((offs_n * 0 + first_block * 32 + 32) < K), other=0).to(tl.int32)
        lo = (lo << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
        hi = (hi << 23).to(tl.float32, bitcast=True)
        scale = tl.where((offs_k[:, None] % 64) < 32, lo[None, :], hi[None, :])
        tile = (values * scale).to(tl.bfloat16)  # exact: e4m3 times a power of two
    return tile


@triton.jit
def _block_scaled_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K,
                              stride_am, stride_ag, stride_wn, stride_wg, stride_sn, stride_sg, stride_cm, stride_cg,
                              B_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, OUT_F32: tl.constexpr,
                              EXACT_DOT: tl.constexpr):  # EXACT_DOT: interpreted
    pid_n, pid_m, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptr += group * stride_ag
    w_ptr += group * stride_wg
    s_ptr += group * stride_sg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = weight_tile(w_ptr, s_ptr, k0, offs_n, N, K, stride_wn, stride_sn, B_FMT, BLOCK_K)
        if EXACT_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c_ptr += group * stride_cg
    out = acc if OUT_F32 else to_bf16(acc, EXACT_DOT)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], out, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def bf16_mm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, fmt: WeightFormat,
                      groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M, G*K]`` bf16 (group g reads columns g*K..) times ``W [G*N, K]`` (FP8, or BF16 with
    ``scales`` None) -> ``[M, G*N]`` in ``out_dtype``."""
    m = a.shape[0]
    k = a.shape[1] // groups
    n = values.shape[0] // groups
    c = torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    if a.stride(1) != 1:
        a = a.contiguous()
    cfg = bf16_mm_config(m)
    if fmt is WeightFormat.BF16:
        w, s, scale_rows_per_group = values, values, 0
    else:
        w, s = values.view(torch.uint8), scales.view(torch.uint8)
        scale_rows_per_group = n // 32
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), groups)
    _block_scaled_gemm_kernel[grid](
        a, w, s, c, m, n, k,
        a.stride(0), k, w.stride(0), n * w.stride(0), s.stride(0), scale_rows_per_group * s.stride(0),
        c.stride(0), n,
        B_FMT=FORMAT_CODES[fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
        OUT_F32=out_dtype == torch.float32, EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c
