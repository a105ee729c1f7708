"""Triton kernel of RMSNorm (twin: ``model.layers.rms_norm``).

``rms_norm(x, weight, eps)``: each row of ``x [..., D]`` in fp32, times ``rsqrt(mean(x**2) + eps)``,
then times the weight (in fp32), rounded back to ``x``'s dtype. One program per row, the whole row
in registers: one launch where the twin takes six kernels (the cast, the square, the mean, the
rsqrt, two products and the cast back): ``q_norm`` and the compressor's norms (the sub-layers' inputs
and the window's KV rows are normed inside ``triton_sublayer_input`` and ``triton_window_kv``).

``fp8_ready``: the normed rows also (or only) as the FP8 linears take them: their FP8 round trip per 32
(``quant.fp8_qdq`` of the bf16 result, exactly), computed from the row already in registers, so the
products that read them skip the round trip's own launch (``KernelBackend.rms_norm``).

The norm's arithmetic (``normed_row``, ``store_normed``) is shared with ``triton_sublayer_input``, which
norms a sub-layer's input in the launch that collapses mHC's stream.

Arithmetic: the twin's operations in its order, with fusion off. The mean's sum runs in another
order than torch's reduction, and ``rsqrt`` is CUDA's ``rsqrtf`` (torch's on the GPU; numpy's in
the interpreter), so the fp32 result can differ from the twin's by a few ulps and, now and then,
its rounding to bf16 by one ulp (``tests/test_triton_rms_norm.py`` states the check). Each row is
computed alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .triton_common import INTERPRETED, fp8_round_trip_row, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel


# what the kernel writes: the normed rows, their FP8 round trip, or both (the round trip to ``out2``)
PLAIN, ROUND_TRIP, BOTH = 0, 1, 2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, out2_ptr, D, inv_d, stride_x, stride_o, stride_o2, eps,
                     BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, OUTPUTS: tl.constexpr, PDL: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a model weight: before the wait
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)  # (the next product then loads its first weights while this row is normed)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_normed(normed_row(x, weight, inv_d, eps, INTERPRETED), out_ptr + row * stride_o, out2_ptr + row * stride_o2,
                 cols, mask, BLOCK_D, OUT_BF16, OUTPUTS, INTERPRETED)


@triton.jit
def normed_row(x, weight, inv_d, eps, INTERPRETED: tl.constexpr):
    """fp32 row ``x`` (zeros past D) RMSNormed, times the fp32 ``weight``, in fp32 (fusion off in the caller)."""
    return weight * (x * norm_factor(x, inv_d, eps, INTERPRETED))


@triton.jit
def norm_factor(x, inv_d, eps, INTERPRETED: tl.constexpr):
    """``rsqrt(mean(x**2) + eps)`` of the fp32 row ``x`` (zeros past D), as the twin computes it."""
    mean = tl.sum(x * x, axis=0) * inv_d  # torch's CUDA mean multiplies by fp32(1 / D)
    if INTERPRETED:
        return 1.0 / tl.sqrt(mean + eps)
    return libdevice.rsqrt(mean + eps)


@triton.jit
def store_normed(y, out_row, out2_row, cols, mask, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr,
                 OUTPUTS: tl.constexpr, INTERPRETED: tl.constexpr):
    """The normed row ``y`` (fp32) stored as ``OUTPUTS`` says: in fp32 (``OUT_BF16`` off), or rounded to
    bf16, its FP8 round trip, or both (the round trip at ``out2_row``)."""
    if not OUT_BF16:
        tl.store(out_row + cols, y, mask=mask)
    else:
        y = to_bf16(y, INTERPRETED)
        if OUTPUTS != 1:  # PLAIN or BOTH
            tl.store(out_row + cols, y, mask=mask)
        if OUTPUTS != 0:  # ROUND_TRIP or BOTH (the columns past D are zeros: whole groups of their own, never stored)
            rounded = fp8_round_trip_row(y, BLOCK_D)
            if OUTPUTS == 1:
                tl.store(out_row + cols, rounded, mask=mask)
            else:
                tl.store(out2_row + cols, rounded, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
             outputs: int = PLAIN) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., D]`` (bf16 or fp32), weight ``[D]`` -> RMSNorm'd ``x`` in its dtype (module docstring);
    ``pdl``: programmatic dependent launch where the GPU has it (``triton_dependent_launch``; ``weight``,
    a model weight that no kernel writes, is then read before the kernel waits for the previous one).
    ``outputs``: ``PLAIN``; ``ROUND_TRIP``, the normed rows' FP8 round trip per 32 instead; ``BOTH``, the
    pair (normed rows, their round trip). The round trip takes bf16 rows, D a multiple of 32."""
    assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
    d = x.shape[-1]
    check_outputs(outputs, x.dtype, d)
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out2 = torch.empty_like(out) if outputs == BOTH else out
    if rows.shape[0]:
        block_d = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, out2, d, 1.0 / d, rows.stride(0), out.stride(0), out2.stride(0), float(eps),
            BLOCK_D=block_d, OUT_BF16=x.dtype == torch.bfloat16, OUTPUTS=outputs, INTERPRETED=INTERPRETED,
            num_warps=row_warps(block_d), enable_fp_fusion=False, **launch_arguments(pdl, x.device))
    if outputs == BOTH:
        return out.view(x.shape), out2.view(x.shape)
    return out.view(x.shape)


def check_outputs(outputs: int, dtype: torch.dtype, d: int) -> None:
    if outputs != PLAIN and (dtype != torch.bfloat16 or d % 32):
        raise ValueError(f"the FP8 round trip takes bf16 rows of a multiple of 32, got {dtype} rows of {d}")


def row_warps(block_d: int) -> int:
    """Warps of a program that holds one row of ``block_d`` values: 16 values per thread, 1 to 16 warps."""
    return min(16, max(1, block_d // 512))
