"""Triton kernel of RMSNorm (twin: ``model.layers.rms_norm``).

``rms_norm(x, weight, eps)``: each row of ``x [..., D]`` in fp32, times ``rsqrt(mean(x**2) + eps)``,
then times the weight (in fp32), rounded back to ``x``'s dtype. One program per row, the whole row
in registers: one launch where the twin takes six kernels (the cast, the square, the mean, the
rsqrt, two products and the cast back), ~8 calls per layer.

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

from .triton_common import INTERPRETED, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, inv_d, stride_x, stride_o, eps, BLOCK_D: tl.constexpr,
                     OUT_BF16: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a model weight: before the wait
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)  # (the next product then loads its first weights while this row is normed)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, axis=0) * inv_d  # torch's CUDA mean multiplies by fp32(1 / D)
    if INTERPRETED:
        factor = 1.0 / tl.sqrt(mean + eps)
    else:
        factor = libdevice.rsqrt(mean + eps)
    y = weight * (x * factor)
    if OUT_BF16:
        tl.store(out_ptr + row * stride_o + cols, to_bf16(y, INTERPRETED), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x ``[..., D]`` (bf16 or fp32), weight ``[D]`` -> RMSNorm'd ``x`` in its dtype (module docstring);
    ``pdl``: programmatic dependent launch where the GPU has it (``triton_dependent_launch``; ``weight``,
    a model weight that no kernel writes, is then read before the kernel waits for the previous one)."""
    assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block_d = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, d, 1.0 / d, rows.stride(0), out.stride(0), float(eps), BLOCK_D=block_d,
            OUT_BF16=x.dtype == torch.bfloat16, INTERPRETED=INTERPRETED, num_warps=min(16, max(1, block_d // 512)),
            enable_fp_fusion=False, **launch_arguments(pdl, x.device))
    return out.view(x.shape)
