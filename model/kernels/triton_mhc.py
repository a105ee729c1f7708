"""Triton kernels of mHC's stream mixes (twins: ``model.mhc.collapse`` and ``model.mhc.expand``).

``collapse(stream, pre)``: ``[T, hc, D]`` bf16 x ``[T, hc]`` fp32 -> ``[T, D]``, the weighted sum of
the copies in fp32, rounded to bf16. ``expand(output, residual, post, comb)``: ``y[t, k] = post[t, k]
* output[t] + sum_j comb[t, j, k] * residual[t, j]`` in fp32, rounded to bf16 (``[T, hc, D]``).
Four calls per layer; the twins take 4 and 7 kernels each (and write fp32 ``[T, hc, hc, D]``
intermediates), these one.

Arithmetic: the twins' products, each rounded (fusion off), summed over the copies ``j`` in
increasing order from zero, as torch's reduction over that (non-innermost) axis does; then
``post * output`` is added. Torch does not promise that order, so results are checked against the
twins within one bf16 ulp (``tests/test_triton_rope_mhc.py``). Each (row, feature block) is computed
alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, to_bf16

BLOCK_D = 1024  # features per program


@triton.jit
def _collapse_kernel(stream_ptr, pre_ptr, out_ptr, D, stride_st, stride_sh, stride_pt, stride_ot,
                     HC: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(HC):
        copy = tl.load(stream_ptr + t * stride_st + j * stride_sh + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(pre_ptr + t * stride_pt + j) * copy
    tl.store(out_ptr + t * stride_ot + cols, to_bf16(acc, INTERPRETED), mask=mask)


@triton.jit
def _expand_kernel(output_ptr, residual_ptr, post_ptr, comb_ptr, y_ptr, D, stride_ot, stride_rt, stride_rh,
                   stride_yt, stride_yh, HC: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    k = tl.arange(0, HC)
    acc = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):  # y[k] += comb[j, k] * residual[j]
        copy = tl.load(residual_ptr + t * stride_rt + j * stride_rh + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(comb_ptr + t * (HC * HC) + j * HC + k)[:, None] * copy[None, :]
    output = tl.load(output_ptr + t * stride_ot + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(post_ptr + t * HC + k)[:, None] * output[None, :] + acc
    tl.store(y_ptr + t * stride_yt + k[:, None] * stride_yh + cols[None, :], to_bf16(y, INTERPRETED),
             mask=mask[None, :])


def collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``[T, hc, D]`` bf16 x ``[T, hc]`` fp32 -> ``[T, D]`` bf16 (module docstring)."""
    t, hc, d = stream.shape
    assert stream.dtype == torch.bfloat16 and stream.stride(-1) == 1, (stream.dtype, stream.stride())
    out = torch.empty(t, d, dtype=torch.bfloat16, device=stream.device)
    if t:
        pre = pre.float()
        _collapse_kernel[(t, triton.cdiv(d, BLOCK_D))](
            stream, pre, out, d, stream.stride(0), stream.stride(1), pre.stride(0), out.stride(0), HC=hc,
            BLOCK_D=BLOCK_D, INTERPRETED=INTERPRETED, num_warps=4, enable_fp_fusion=False)
    return out


def expand(output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """output ``[T, D]`` bf16, residual ``[T, hc, D]`` bf16, post ``[T, hc]``, comb ``[T, hc, hc]`` fp32
    -> ``[T, hc, D]`` bf16 (module docstring)."""
    t, hc, d = residual.shape
    assert output.dtype == residual.dtype == torch.bfloat16, (output.dtype, residual.dtype)
    assert output.stride(-1) == 1 and residual.stride(-1) == 1
    y = torch.empty(t, hc, d, dtype=torch.bfloat16, device=output.device)
    if t:
        post, comb = post.float().contiguous(), comb.float().contiguous()
        _expand_kernel[(t, triton.cdiv(d, BLOCK_D))](
            output, residual, post, comb, y, d, output.stride(0), residual.stride(0), residual.stride(1),
            y.stride(0), y.stride(1), HC=hc, BLOCK_D=BLOCK_D, INTERPRETED=INTERPRETED, num_warps=4,
            enable_fp_fusion=False)
    return y
