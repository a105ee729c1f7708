"""Triton kernels of the block-scaled linear layers (twin: ``model/gemm.py::block_scaled_linear``).

* ``act_quant``: the activation's FP8 round trip, per row and group of 32 (UE8M0 scale read off the
  fp32 bits as the reference does, e4m3 round-to-nearest-even with saturation), written back as
  bf16 (exact: e4m3 times a power of two fits bf16). One launch before the product, shared by
  every N tile, instead of re-quantizing the same rows in every program of the GEMM.
* ``block_scaled_gemm``: ``A [M, K] bf16 x W[N, K]^T`` with W in its storage format: FP8 e4m3 with
  one UE8M0 scale per 32x32 tile, or packed FP4 e2m1 (low nibble first) with one UE8M0 scale per
  row per 32 along K. Weight tiles are expanded in registers (values times their power-of-two
  scale, exact in bf16) and multiplied on the tensor cores with fp32 accumulation. A leading group
  axis runs several weight slices in one launch (the grouped output projection ``wo_a``).

Numerics against the reference: the activation round trip is bit-exact; each product of a quantized
activation and a weight element is exact in fp32, and both sum those products in fp32, the
reference per 32-block and then across blocks, the tensor cores in their own order. Results agree
to fp32 rounding before the final bf16 rounding (tests bound the difference by one bf16 ulp of the
row's scale). Batch invariance by construction: one program owns a whole output tile and walks K
from 0 to K in steps of ``BLOCK_K`` (no split-K), every tile config uses the same instruction
shapes, so a row's result never depends on M.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import gemm_config

FORMAT_CODES = {WeightFormat.FP8: 0, WeightFormat.FP4: 1, WeightFormat.BF16: 2}
# Under the interpreter (the CPU tests) two conversions differ from the GPU's: bf16 dot operands are
# multiplied wrongly and fp32 -> bf16 truncates (triton 3.9). There the dot runs on fp32 operands
# (the same exact products) and bf16 rounding is done on the bits.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 64  # two scale blocks of 32 per step; fixed so every config sums K in the same steps


@triton.jit
def round_to_e4m3(q):
    """fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), as fp32.

    Done on the bits rather than with a conversion instruction so that it is exact wherever it
    runs (the interpreter too): normal values keep 3 mantissa bits; below 2**-6 (e4m3 subnormals)
    values round to a multiple of 2**-9 through an fp32 addition, whose rounding is to nearest even.
    """
    bits = q.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0  # 24576 = 1.5 * 2**14: its fp32 ulp is 2**-9
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal)


@triton.jit
def to_bf16(x, INTERPRETED: tl.constexpr):
    """fp32 -> bf16, rounding to nearest even (the interpreter's own conversion truncates)."""
    if INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def qdq_groups_of_32(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 [ROWS, COLS] -> the FP8 e4m3 round trip of every group of 32 along a row (fp32, exact)."""
    g = tl.reshape(x, (ROWS, COLS // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    bits = (amax * 0.002232142857142857).to(tl.int32, bitcast=True)  # amax * fp32(1/448)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2) + 127
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    q = tl.minimum(tl.maximum(g * inverse[:, :, None], -448.0), 448.0)
    return tl.reshape(round_to_e4m3(q) * scale[:, :, None], (ROWS, COLS))


@triton.jit
def _act_quant_kernel(x_ptr, y_ptr, M, K, stride_x, stride_y, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = qdq_groups_of_32(x, BLOCK_ROWS, BLOCK_COLS)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def weight_tile(w_ptr, s_ptr, k0, offs_n, N, K, stride_wn, stride_sn, B_FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The bf16 tile ``W[offs_n, k0:k0+64]^T`` ([64, BLOCK_N]) of a stored weight, scales applied.

    ``k0`` is a multiple of 64, so the tile spans two 32-blocks: each column needs two scales.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    if B_FMT == 2:  # a plain bf16 weight
        return tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0)
    if B_FMT == 0:
        raw = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0)
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_row = offs_n // 32  # one scale per 32x32 tile
    else:
        raw = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] // 2, mask=mask, other=0).to(tl.int32)
        nibble = (raw >> ((offs_k[:, None] % 2) * 4)) & 0xF
        # e2m1 (s, e1 e0, m) placed in fp16's sign and low exponent/mantissa bits is its value times
        # 2**-14, subnormal codes included; the conversion to fp32 and the 2**14 are exact
        half = (((nibble & 8) << 12) | ((nibble & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        values = half.to(tl.float32) * 16384.0
        scale_row = offs_n  # one scale per row per 32 along K
    first_block = k0 // 32
    n_mask = offs_n < N
    lo = tl.load(s_ptr + scale_row * stride_sn + first_block, mask=n_mask, other=0).to(tl.int32)
    hi = tl.load(s_ptr + scale_row * stride_sn + first_block + 1, mask=n_mask & ((offs_n * 0 + first_block * 32 + 32) < K),
                 other=0).to(tl.int32)
    lo = (lo << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
    hi = (hi << 23).to(tl.float32, bitcast=True)
    scale = tl.where((offs_k[:, None] % 64) < 32, lo[None, :], hi[None, :])
    return (values * scale).to(tl.bfloat16)


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


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``[M, K]`` -> its FP8 round trip per 32 (bf16, same shape); K a multiple of 32."""
    m, k = x.shape
    y = torch.empty_like(x)
    if m == 0:
        return y
    rows, cols = 4, 512
    grid = (triton.cdiv(m, rows), triton.cdiv(k, cols))
    _act_quant_kernel[grid](x, y, m, k, x.stride(0), y.stride(0), BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=4)
    return y


def block_scaled_gemm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, fmt: WeightFormat,
                      groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M, G*K]`` bf16 (group g reads columns g*K..) times ``W [G*N, K]`` -> ``[M, G*N]``.

    ``fmt`` BF16 takes a plain bf16 weight (``scales`` None): the fp32 head, whose reference
    multiplies fp32 copies of bf16 values, which is the same exact products."""
    m = a.shape[0]
    k = a.shape[1] // groups
    n = values.shape[0] // groups
    c = torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    if a.stride(1) != 1:
        a = a.contiguous()
    cfg = gemm_config(m, n, k)
    if fmt is WeightFormat.BF16:
        w, s, scale_rows_per_group = values, values, 0
    else:
        w, s = values.view(torch.uint8), scales.view(torch.uint8)
        scale_rows_per_group = n // 32 if fmt is WeightFormat.FP8 else n
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), groups)
    _block_scaled_gemm_kernel[grid](
        a, w, s, c, m, n, k,
        a.stride(0), k, w.stride(0), n * w.stride(0), s.stride(0), scale_rows_per_group * s.stride(0),
        c.stride(0), n,
        B_FMT=FORMAT_CODES[fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K,
        OUT_F32=out_dtype == torch.float32, EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c
