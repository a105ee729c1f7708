"""Triton kernel of the FP4 quantize-dequantize round trip (twin: ``model.quant.fp4_qdq``), bit for bit.

``fp4_round_trip(x, block, e4m3_scale)``: bf16 ``[..., K]`` -> bf16, each group of ``block`` values
along the last axis quantized to e2m1 and multiplied back by its scale:

* ``block=32, e4m3_scale=False`` (index queries and keys): a power-of-two scale, 2**ceil(log2(amax *
  fp32(1/6))) read off the fp32 bits, amax floored at 6 * 2**-126;
* ``block=16, e4m3_scale=True`` (compressed KV): the E4M3 value of ``max(amax, 6 * 2**-9) / 6``.

Values are divided by their scale (IEEE), clamped to [-6, 6] and rounded to the nearest e2m1
magnitude (ties to the even code), keeping the sign (so -0.0 stays -0.0). Every step is exact or
correctly rounded, and an e2m1 value times an E4M3 or power-of-two scale is exact in fp32 and in
bf16, so the kernel equals the twin bit for bit on any device.

Why a kernel: the twin is ~28 torch kernels per call (the group max, the scale from the bits, seven
midpoint comparisons, the value table), three calls per compressed layer in a decode step.

Layout: ``x`` rows of ``K`` contiguous values, read as their int16 bits (``K`` a multiple of
``block``); one program rounds ``BLOCK_ROWS`` rows. Rows are independent: nothing depends on the
batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import round_to_e4m3

FP4_MAX_INV = tl.constexpr(1.0 / 6.0)  # the kernels multiply by this fp32 constant (as quant._FP4_MAX_INV)
MIN_POW2_AMAX = tl.constexpr(6 * 2.0 ** -126)
MIN_E4M3_AMAX = tl.constexpr(6 * 2.0 ** -9)
BLOCK_ELEMENTS = 4096  # values per program


@triton.jit
def _e2m1_magnitude(v):
    """|v| in [0, 6] -> the nearest e2m1 magnitude; at a midpoint the even code (the upper neighbour
    only at 0.75, 1.75 and 3.5)."""
    r = tl.where(v > 0.25, 0.5, 0.0)
    r = tl.where(v >= 0.75, 1.0, r)
    r = tl.where(v > 1.25, 1.5, r)
    r = tl.where(v >= 1.75, 2.0, r)
    r = tl.where(v > 2.5, 3.0, r)
    r = tl.where(v >= 3.5, 4.0, r)
    return tl.where(v > 5.0, 6.0, r)


@triton.jit
def _fp4_round_trip_kernel(x_ptr, out_ptr, R, K, stride_x, stride_o, GROUP: tl.constexpr, E4M3_SCALE: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    # bf16 bits -> fp32 bits: exact for every value (the interpreter's cast mangles bf16 subnormals)
    bits = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0)
    x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    groups = tl.reshape(x, (BLOCK_ROWS, BLOCK_K // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    if E4M3_SCALE:
        scale = round_to_e4m3(tl.minimum(tl.div_rn(tl.maximum(amax, MIN_E4M3_AMAX), 6.0), 448.0))
    else:
        scaled = (tl.maximum(amax, MIN_POW2_AMAX) * FP4_MAX_INV).to(tl.int32, bitcast=True)
        exponent = ((scaled >> 23) & 0xFF) + ((scaled & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2) + 127
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(tl.div_rn(groups, scale[:, :, None]), -6.0), 6.0)
    magnitude = _e2m1_magnitude(tl.abs(v)) * scale[:, :, None]
    # the sign is x's (dividing by a positive scale and clamping keep it), set on the bits so that
    # -0.0 stays -0.0: the compiler may drop the sign of a zero in a float negation or select
    sign = groups.to(tl.int32, bitcast=True) & -0x80000000
    y = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :],
             tl.reshape(y, (BLOCK_ROWS, BLOCK_K)).to(tl.bfloat16), mask=mask)


def fp4_round_trip(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    """bf16 ``[..., K]`` -> its FP4 round trip in bf16 (module docstring)."""
    assert x.dtype == torch.bfloat16, "the FP4 round trip takes bf16 input"
    k = x.shape[-1]
    assert k % block == 0, f"{k} values do not split into groups of {block}"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.bfloat16, device=x.device)
    if rows.shape[0]:
        block_k = max(block, triton.next_power_of_2(k))
        block_rows = max(1, BLOCK_ELEMENTS // block_k)
        _fp4_round_trip_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows.view(torch.int16), out, rows.shape[0], k, rows.stride(0), out.stride(0), GROUP=block,
            E4M3_SCALE=e4m3_scale,
            BLOCK_ROWS=block_rows, BLOCK_K=block_k, num_warps=4)
    return out.view(x.shape)
