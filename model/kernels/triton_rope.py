"""Triton kernel of the rotary embedding, in place (twin: ``model.rope.RotaryTable.rotate_``).

``rotate_(x, positions, table, inverse)``: the trailing dims of ``x`` (a bf16 view ``[T, R]`` or
``[T, H, R]`` into a larger tensor, its last dim contiguous) taken as ``R / 2`` complex pairs
``(x[2i], x[2i + 1])``, each multiplied by the row's rotation ``table[positions[t], i]`` (its
conjugate with ``inverse``), in fp32, and written back rounded to bf16. One launch where the twin
takes six kernels (the table gather, the cast, the complex product, the copy back), six calls per
compressed layer.

Arithmetic: ``(a + ib)(c + id) = (ac - bd) + i(ad + bc)``, each product rounded (fusion off). Torch's
complex product may contract one of them into an FMA, so the fp32 results can differ by an ulp and
the bf16 result, rarely, by one bf16 ulp (``tests/test_triton_rope_mhc.py`` states the check).
Each (row, head) is computed alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, bf16_exact, to_bf16

BLOCK_H = 16  # heads per program
NUM_WARPS = 2  # 16 heads x 32 pairs x 2 values at V4.1-Flash: 1,024 values, 16 per thread


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, table_ptr, H, stride_xt, stride_xh, stride_p, HALF: tl.constexpr,
                 INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, HALF)
    mask = heads[:, None] < H
    position = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(table_ptr + position * stride_p + 2 * pairs)[None, :]
    sin = tl.load(table_ptr + position * stride_p + 2 * pairs + 1)[None, :]
    if INVERSE:
        sin = -sin
    # each pair loaded and stored together (one contiguous run of 2 * HALF values per head), split in registers
    base = x_ptr + t * stride_xt + heads[:, None, None] * stride_xh + 2 * pairs[None, :, None] + tl.arange(0, 2)
    both = bf16_exact(tl.load(base, mask=mask[:, :, None], other=0.0))  # [BLOCK_H, HALF, 2]
    a, b = tl.split(both)
    rotated = tl.join(a * cos - b * sin, a * sin + b * cos)
    tl.store(base, to_bf16(rotated, INTERPRETED), mask=mask[:, :, None])


@triton.jit
def rotate_with_partner(x, partner, second, cos, sin):
    """fp32 rotation of values ``x`` whose pair partners are ``partner`` (``second``: ``x`` is its pair's
    second value), in ``_rope_kernel``'s order, so the same bits: ``a cos - b sin`` for a pair ``(a, b)``'s
    first value, ``a sin + b cos`` for its second (pass ``-sin`` to rotate back). Kernels that take RoPE
    into a launch of their own (the FP4 round trip) load each value's partner at column ``c ^ 1``."""
    return tl.where(second, partner * sin + x * cos, x * cos - partner * sin)


def rotate_(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` (bf16 ``[T, R]`` or ``[T, H, R]``) in place by ``table`` (complex64 ``[P, R / 2]``) at
    ``positions [T]``; returns ``x`` (module docstring)."""
    assert x.dtype == torch.bfloat16 and x.stride(-1) == 1, (x.dtype, x.stride())
    t, r = x.shape[0], x.shape[-1]
    if t == 0:
        return x
    heads, stride_h = (x.shape[1], x.stride(1)) if x.ndim == 3 else (1, 0)
    real = torch.view_as_real(table)  # [P, R / 2, 2] fp32: (cos, sin) pairs
    _rope_kernel[(t, triton.cdiv(heads, BLOCK_H))](
        x, positions, real, heads, x.stride(0), stride_h, real.stride(0), HALF=r // 2, INVERSE=inverse,
        BLOCK_H=BLOCK_H, INTERPRETED=INTERPRETED, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return x
