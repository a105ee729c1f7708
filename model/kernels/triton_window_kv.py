"""Triton kernel of the attention's KV rows (twin: ``KernelBackend.window_kv``'s three steps).

``window_kv(kv, weight, eps, positions, table)``: each token's KV row ``[D]`` bf16 (``wkv``'s output),
RMSNormed with ``weight`` (``triton_rms_norm``'s arithmetic), its last ``R`` dims rotated by the
token's RoPE rotation (``triton_rope``'s arithmetic), then rounded through FP8 per 32 (``quant.fp8_qdq``)
-> bf16 ``[T, D]``: the rows the window stores and the attention reads. One launch where the three
kernels took three, once per layer in every step.

Each step's arithmetic is its kernel's, in the same order with fusion off, so the rows equal the
three launches' bit for bit (tested). A program holds one row: the normed row in registers for the
first ``D - R`` dims, and the last ``R`` dims loaded again as ``R / 2`` (even, odd) pairs, normed by
the same factor and rotated; ``R`` is a whole number of groups of 32 at the row's end, so the round
trip takes the two parts' groups apart. Each row is computed alone: nothing depends on the batch.

``ring``: in a decode step the rows also go into the window's ring (``cache_formats.WINDOW_KV``: D e4m3
bytes, then a UE8M0 scale byte per 32), encoded by ``triton_cache_codec``'s arithmetic
(``fp8_group_bytes``) into the same bytes its writer stores: the step's ring write, a launch per layer,
taken into this one. (The attention reads the rings after this launch; the row each sequence overwrites
holds the position one before its window, which no list holds.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cache_formats import ElementFormat, RowFormat, ScaleFormat
from .triton_cache_codec import fp8_group_bytes
from .triton_common import INTERPRETED, bf16_exact, fp8_round_trip_row, to_bf16
from .triton_rms_norm import norm_factor, row_warps


@triton.jit
def _store_ring_part(values, ring_row, cols, first_col, cols_stored, D, UE8M0: tl.constexpr, WIDTH: tl.constexpr):
    """A part of a row (bf16 ``values [WIDTH]`` for columns ``first_col + cols``, whole groups of 32, the first
    ``cols_stored`` of them stored) encoded into the ring row at ``ring_row``: codes at its byte ``first_col``
    on, their scale bytes after the row's ``D`` codes (``triton_cache_codec``'s FP8 row)."""
    codes, scale_bytes = fp8_group_bytes(tl.reshape(bf16_exact(values), (1, WIDTH // 32, 32)), UE8M0)
    tl.store(ring_row + first_col + cols, tl.reshape(codes, (WIDTH,)).to(tl.uint8), mask=cols < cols_stored)
    groups = tl.arange(0, WIDTH // 32)
    tl.store(ring_row + D + first_col // 32 + groups, tl.reshape(scale_bytes, (WIDTH // 32,)).to(tl.uint8),
             mask=groups * 32 < cols_stored)


@triton.jit
def _window_kv_kernel(x_ptr, w_ptr, pos_ptr, table_ptr, out_ptr, ring_ptr, ring_rows_ptr, D, inv_d, stride_x,
                      stride_o, stride_p, eps, BLOCK_D: tl.constexpr, HALF: tl.constexpr, RING: tl.constexpr,
                      UE8M0: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    factor = norm_factor(x, inv_d, eps, INTERPRETED)  # triton_rms_norm's arithmetic
    rounded = fp8_round_trip_row(to_bf16(weight * (x * factor), INTERPRETED), BLOCK_D)
    tl.store(out_ptr + row * stride_o + cols, rounded, mask=cols < D - 2 * HALF)
    if RING:  # the row's bytes in the window's ring too (rows of D codes, then D / 32 scale bytes)
        ring_row = ring_ptr + tl.load(ring_rows_ptr + row) * (D + D // 32)
        _store_ring_part(rounded, ring_row, cols, 0, D - 2 * HALF, D, UE8M0, BLOCK_D)

    # the last 2 * HALF dims as (even, odd) pairs: normed again (the same products), then triton_rope's rotation
    pairs = tl.arange(0, HALF)
    tail = D - 2 * HALF + 2 * pairs[:, None] + tl.arange(0, 2)[None, :]  # [HALF, 2]
    tail_x = tl.load(x_ptr + row * stride_x + tail).to(tl.float32)
    tail_w = tl.load(w_ptr + tail).to(tl.float32)
    a, b = tl.split(bf16_exact(to_bf16(tail_w * (tail_x * factor), INTERPRETED)))
    position = tl.load(pos_ptr + row).to(tl.int64)
    cos = tl.load(table_ptr + position * stride_p + 2 * pairs)
    sin = tl.load(table_ptr + position * stride_p + 2 * pairs + 1)
    rotated = to_bf16(tl.join(a * cos - b * sin, a * sin + b * cos), INTERPRETED)  # [HALF, 2]
    tail_rounded = fp8_round_trip_row(tl.reshape(rotated, (2 * HALF,)), 2 * HALF)
    tl.store(out_ptr + row * stride_o + tl.reshape(tail, (2 * HALF,)), tail_rounded)
    if RING:
        _store_ring_part(tail_rounded, ring_row, tl.arange(0, 2 * HALF), D - 2 * HALF, 2 * HALF, D, UE8M0, 2 * HALF)


def takes(d: int, rope_dims: int) -> bool:
    """Whether the kernel takes rows of ``d`` dims with a RoPE part of ``rope_dims``: both whole groups of
    32 (the round trip's), the RoPE part a power of two (its pairs' register shape)."""
    return d % 32 == 0 and rope_dims % 32 == 0 and rope_dims & (rope_dims - 1) == 0 and 0 < rope_dims <= d


def stores(fmt: RowFormat) -> bool:
    """Whether the kernel can store its rows in a cache of rows of ``fmt`` as well: FP8 in groups of 32, the
    round trip's own (the window's, ``cache_formats.WINDOW_KV``)."""
    return fmt.element is ElementFormat.FP8_E4M3 and fmt.group == 32


def window_kv(kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              table: torch.Tensor, out: torch.Tensor | None = None,
              ring: tuple[torch.Tensor, torch.Tensor, RowFormat] | None = None) -> torch.Tensor:
    """``kv [T, D]`` bf16, ``weight [D]``, ``positions [T]``, ``table`` complex64 ``[P, R / 2]`` (the RoPE
    rotations) -> bf16 ``[T, D]`` (module docstring; ``takes(D, R)``), into ``out`` if given (rows of D
    contiguous values). ``ring``: ``(data, flat rows [T], fmt)``, a cache's bytes (contiguous uint8 rows of
    ``fmt``, ``stores(fmt)``): each row also encoded and stored at its row there, as
    ``triton_cache_codec.write_rows`` stores it (the same bytes), in the same launch."""
    t, d = kv.shape
    half = table.shape[-1]
    if kv.dtype != torch.bfloat16 or not takes(d, 2 * half):
        raise ValueError(f"window_kv takes bf16 rows of a multiple of 32 and a power-of-two rope part of whole "
                         f"groups of 32, got {kv.dtype} rows of {d}, rope dims {2 * half}")
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if out is None:
        out = torch.empty(t, d, dtype=torch.bfloat16, device=kv.device)
    assert out.shape == (t, d) and out.stride(-1) == 1, (out.shape, out.stride())
    ring_data, ring_rows, ring_fmt = ring if ring is not None else (out, out, None)  # (unused without a ring)
    if ring_fmt is not None:
        assert stores(ring_fmt) and ring_data.dtype == torch.uint8 and ring_data.is_contiguous(), ring_fmt
        assert ring_data.shape[-1] == ring_fmt.row_bytes(d) and ring_rows.numel() == t, (ring_data.shape, t)
        ring_rows = ring_rows.reshape(-1)
    if t:
        real = torch.view_as_real(table)  # [P, R / 2, 2] fp32: (cos, sin) pairs
        block_d = triton.next_power_of_2(d)
        _window_kv_kernel[(t,)](kv, weight, positions, real, out, ring_data, ring_rows, d, 1.0 / d, kv.stride(0),
                                out.stride(0), real.stride(0), float(eps), BLOCK_D=block_d, HALF=half,
                                RING=ring_fmt is not None,
                                UE8M0=ring_fmt is not None and ring_fmt.scale is ScaleFormat.UE8M0,
                                INTERPRETED=INTERPRETED, num_warps=row_warps(block_d), enable_fp_fusion=False)
    return out
