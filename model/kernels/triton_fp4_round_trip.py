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

RoPE first (``positions``, ``table``: the indexer's queries, the compressor's keys and entries): the last
``R`` values of each row are rotated at its position (``rows_per_position`` rows share one: a token's
heads) with ``_rope_kernel``'s arithmetic and rounded to bf16, as ``rotate_`` would leave them, before
the round trip: one launch instead of two, the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, bf16_bits_to_f32, bf16_exact, e2m1_code, e2m1_value, fp4_scale, to_bf16
from .triton_rope import rotate_with_partner

# values per program: a decode step's rows are a few thousand values, which 4,096 per program gave to one or
# two programs. On one H100 (``benchmarks/small_kernels.py``; per call, CUDA graphs) the index queries of 1 /
# 16 / 64 tokens took 1.39 / 1.52 / 1.77 µs with 512 against 3.46 / 3.46 / 3.50 with 4,096, the compressed
# KV rows 1.35 / 1.43 / 1.51 against 6.82 / 3.58 / 3.57 (1,024 and 2,048 in between)
BLOCK_ELEMENTS = 512


@triton.jit
def _fp4_round_trip_kernel(x_ptr, out_ptr, pos_ptr, table_ptr, R, K, stride_x, stride_o, stride_p, rows_per_position,
                           GROUP: tl.constexpr, E4M3_SCALE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                           BLOCK_K: tl.constexpr, ROPE_DIMS: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_x
    x = bf16_bits_to_f32(tl.load(x_rows + cols[None, :], mask=mask, other=0))
    if ROPE_DIMS:  # rotated as rotate_ leaves them (module docstring)
        position = tl.load(pos_ptr + rows64 // rows_per_position, mask=rows < R, other=0).to(tl.int64)[:, None]
        rotated_col = (cols >= K - ROPE_DIMS)[None, :] & mask
        pair = tl.where(rotated_col, (cols[None, :] - (K - ROPE_DIMS)) // 2, 0)
        cos = tl.load(table_ptr + position * stride_p + 2 * pair, mask=rotated_col, other=1.0)
        sin = tl.load(table_ptr + position * stride_p + 2 * pair + 1, mask=rotated_col, other=0.0)
        partner = bf16_bits_to_f32(tl.load(x_rows + (cols ^ 1)[None, :], mask=rotated_col, other=0))
        rotated = to_bf16(rotate_with_partner(x, partner, (cols % 2 == 1)[None, :], cos, sin), INTERPRETED)
        x = tl.where(rotated_col, bf16_exact(rotated), x)
    groups = tl.reshape(x, (BLOCK_ROWS, BLOCK_K // GROUP, GROUP))
    scale = fp4_scale(tl.max(tl.abs(groups), axis=2), E4M3_SCALE)[:, :, None]
    # code x scale is exact; the code keeps x's sign (dividing by a positive scale and clamping keep it)
    y = e2m1_value(e2m1_code(tl.minimum(tl.maximum(tl.div_rn(groups, scale), -6.0), 6.0))) * scale
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :],
             tl.reshape(y, (BLOCK_ROWS, BLOCK_K)).to(tl.bfloat16), mask=mask)


def fp4_round_trip(x: torch.Tensor, block: int, e4m3_scale: bool = False, positions: torch.Tensor | None = None,
                   table: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``[..., K]`` -> its FP4 round trip in bf16 (module docstring). With ``positions [P]`` and ``table``
    (complex64 ``[*, R / 2]``, a ``RotaryTable``'s): the last R values rotated first, ``x``'s rows split
    evenly among the positions (``[P, K]`` or ``[P, H, K]``)."""
    assert x.dtype == torch.bfloat16, "the FP4 round trip takes bf16 input"
    k = x.shape[-1]
    assert k % block == 0, f"{k} values do not split into groups of {block}"
    rope_dims, real, per_position = 0, x, 1  # (no RoPE: the table's pointer is not read)
    if table is not None:
        rope_dims, real = 2 * table.shape[-1], torch.view_as_real(table)  # [P, R / 2, 2] fp32: (cos, sin) pairs
        assert (k - rope_dims) % 2 == 0 and rope_dims & (rope_dims - 1) == 0, (k, rope_dims)
        per_position = x.numel() // k // max(1, positions.shape[0])
        positions = positions.contiguous()
    else:
        positions = x
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.bfloat16, device=x.device)
    if rows.shape[0]:
        block_k = max(block, triton.next_power_of_2(k))
        block_rows = max(1, BLOCK_ELEMENTS // block_k)
        _fp4_round_trip_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows.view(torch.int16), out, positions, real, rows.shape[0], k, rows.stride(0), out.stride(0),
            real.stride(0), per_position, GROUP=block, E4M3_SCALE=e4m3_scale, BLOCK_ROWS=block_rows, BLOCK_K=block_k,
            ROPE_DIMS=rope_dims, INTERPRETED=INTERPRETED, num_warps=4)
    return out.view(x.shape)
