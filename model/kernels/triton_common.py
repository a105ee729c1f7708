"""Helpers shared by the Triton kernels: exact FP8/FP4 rounding, codes and scales, exact bf16
conversions, bf16 products and fp32 exp; the GPU's SM count, by which launchers size their grids.

Under Triton's interpreter (the CPU tests) two conversions differ from the GPU's (triton 3.9):
16-bit dot operands are multiplied wrongly and fp32 -> bf16 truncates. ``INTERPRETED`` lets the
kernels take exact routes there: fp32 dot operands (the same exact products) and rounding on the
bits. The e4m3 rounding is always done on the bits, so it is exact on any backend.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP4_MAX_INV = tl.constexpr(1.0 / 6.0)  # the kernels multiply by this fp32 constant (quant._FP4_MAX_INV)
FP4_POW2_FLOOR = tl.constexpr(6 * 2.0 ** -126)  # the floors on a group maximum (quant.fp4_scale)
FP4_E4M3_FLOOR = tl.constexpr(6 * 2.0 ** -9)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H200's 132 where there is no GPU: the interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 132


@triton.jit
def round_to_e4m3(q):
    """fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), as fp32.

    Normal values keep 3 mantissa bits; below 2**-6 (e4m3 subnormals) values round to a multiple
    of 2**-9 through an fp32 addition, whose rounding is to nearest even; the sign is put back on
    the bits, since the addition turns a tiny negative into +0.0 where the cast gives -0.0.
    """
    bits = q.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0  # 24576 = 1.5 * 2**14: its fp32 ulp is 2**-9
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal)


@triton.jit
def dot_bf16(a, b, INTERPRETED: tl.constexpr):
    """bf16 ``a @ b`` with fp32 accumulation."""
    if INTERPRETED:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def exp_f32(x, INTERPRETED: tl.constexpr):
    """fp32 exp: CUDA's ``expf`` on the GPU, what torch runs (tl.exp would be ``ex2.approx``); numpy's
    in the interpreter."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def to_bf16(x, INTERPRETED: tl.constexpr):
    """fp32 -> bf16, rounding to nearest even."""
    if INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def quantize_blocks(g):
    """fp32 ``[..., 32]`` (groups of 32 along the last axis) -> (e4m3 values ``[..., 32]`` as fp32,
    scales ``[...]``).

    The reference's ``act_quant``: per group of 32, scale = 2**ceil(log2(amax / 448)) read off the
    fp32 bits (amax floored at 1e-4), values divided by it (exact), saturated at 448 and rounded to
    nearest even.
    """
    amax = tl.maximum(tl.max(tl.abs(g), axis=-1), 1e-4)
    bits = (amax * 0.002232142857142857).to(tl.int32, bitcast=True)  # amax * fp32(1/448)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2) + 127
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    q = round_to_e4m3(tl.minimum(tl.maximum(g * tl.expand_dims(inverse, -1), -448.0), 448.0))
    return q, scale


@triton.jit
def quantize_groups_of_32(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 ``[ROWS, COLS]`` -> (e4m3 values ``[ROWS, COLS]`` as fp32, scales ``[ROWS, COLS/32]``):
    ``quantize_blocks`` over each row's groups of 32."""
    q, scale = quantize_blocks(tl.reshape(x, (ROWS, COLS // 32, 32)))
    return tl.reshape(q, (ROWS, COLS)), scale


@triton.jit
def fp8_round_trip_groups(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 ``[ROWS, COLS]`` holding bf16 values -> their FP8 round trip per 32 (``quant.fp8_qdq``: each
    e4m3 value times its group's scale), fp32 and exact in bf16."""
    q, scale = quantize_blocks(tl.reshape(x, (ROWS, COLS // 32, 32)))
    return tl.reshape(q * scale[:, :, None], (ROWS, COLS))


@triton.jit
def bf16_exact(y):
    """bf16 values as fp32, exactly (``bf16_bits_to_f32`` of their bits)."""
    return bf16_bits_to_f32(y.to(tl.int16, bitcast=True))


@triton.jit
def fp8_round_trip_row(y, BLOCK: tl.constexpr):
    """bf16 ``[BLOCK]`` (whole groups of 32) -> its FP8 round trip per 32 (``quant.fp8_qdq``), bf16: what a
    kernel that makes a quantized linear's input writes as FP8-ready rows (``backend.py``)."""
    rounded = fp8_round_trip_groups(tl.reshape(bf16_exact(y), (1, BLOCK)), 1, BLOCK)
    return tl.reshape(rounded, (BLOCK,)).to(tl.bfloat16)


@triton.jit
def bf16_bits_to_f32(bits):
    """The int16 bits of bf16 values -> fp32, exact for every value (the interpreter's float cast
    mangles bf16 subnormals)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale(amax, floor, max_inv):
    """2**ceil(log2(max(amax, floor) * max_inv)), read off the fp32 bits (``quant.pow2_scale``)."""
    bits = (tl.maximum(amax, floor) * max_inv).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2) + 127
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp4_scale(amax, E4M3_SCALE: tl.constexpr):
    """The scale of an FP4 group with largest magnitude ``amax`` (``quant.fp4_scale``): the E4M3 value
    of ``max(amax, 6 * 2**-9) / 6``, or a power of two (UE8M0)."""
    if E4M3_SCALE:
        return round_to_e4m3(tl.minimum(tl.div_rn(tl.maximum(amax, FP4_E4M3_FLOOR), 6.0), 448.0))
    else:
        return pow2_scale(amax, FP4_POW2_FLOOR, FP4_MAX_INV)


@triton.jit
def e2m1_code(v):
    """fp32 in [-6, 6] -> 4-bit e2m1 code (int32; bit 3 the sign, so -0.0 is code 8): the nearest
    magnitude, at a midpoint the even code (the upper neighbour only at 0.75, 1.75 and 3.5)."""
    m = tl.abs(v)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
            + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def e2m1_value(code):
    """4-bit e2m1 code (int32; bit 3 the sign) -> fp32 value, the sign set on the bits (the compiler
    may drop the sign of a zero in a float negation or select)."""
    c = code & 7
    magnitude = tl.where(c < 4, c.to(tl.float32) * 0.5, tl.where(c == 7, 6.0, (c - 2).to(tl.float32)))
    return (magnitude.to(tl.int32, bitcast=True) | ((code >> 3) << 31)).to(tl.float32, bitcast=True)
