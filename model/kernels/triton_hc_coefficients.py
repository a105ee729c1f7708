"""Triton kernels of mHC's coefficients from the stream (twin: ``HyperConnection.mixes`` then
``model.mhc.split_sinkhorn``).

``hc_coefficients(stream, fn, scale, base, hc, iters, hc_eps, norm_eps)``: each token's stream
``[hc, D]`` bf16, flattened to ``x [K = hc * D]``, gives the raw mixes ``(fn @ x) * rsqrt(mean(x^2) +
norm_eps)`` (``fn [(2 + hc) * hc, K]`` fp32) and from them pre ``[hc]``, post ``[hc]`` and comb
``[hc, hc]`` (``triton_sinkhorn``). Two launches:

1. ``_mix_partials_kernel``: a program per (block of tokens, slice of ``SPLIT_K`` columns) multiplies
   the slice of the tokens' rows (read in bf16) by the slice of ``fn`` and sums their squares, and
   writes ``[(2 + hc) * hc + 1]`` partial sums per token and slice.
2. ``triton_sinkhorn``'s kernel adds each token's slices in increasing order, applies the rsqrt and
   runs the split and the Sinkhorn iterations.

Why: torch computes the mixes from an fp32 copy of the stream (``[T, 20480]`` for V4.1-Flash: 671 MB
at an 8K prefill, written once and read three times), a square, a mean and an fp32 product: ~7
kernels and ~2.1 ms per call at 8K tokens, twice per layer, and 8 of a one-token step's ~160
launches per layer. Here the stream is read once, in bf16.

Arithmetic: the products are exact and summed in fp32, never TF32. ``fn`` is fp32 and the stream
bf16, so each ``fn`` tile is split into three bf16 parts that add up to it exactly
(``_split_bf16``), and three bf16 tensor-core products give the exact products ``x * fn``. (An fp32
``tl.dot`` in IEEE mode runs on the CUDA cores instead: it measured ~1.5 ms per call at 8K tokens on
one H200, 7 TFLOP/s.) Each step's products are summed on the tensor cores and the step's sum is
added to the total by an fp32 addition: accumulating all 20,480 columns on the tensor cores (whose
additions are not IEEE fp32 additions) failed the twin's tolerance and the golden set's statistical
check on the H200. The sums run in another order than torch's, so the mixes differ from the twin's
by fp32 rounding (``tests/test_triton_hc_coefficients.py`` states the tolerance). The slices are
fixed (``SPLIT_K``) and so is the token block (``BLOCK_T``, one instruction shape), and each token's
sums depend on its own row only: no result depends on the batch. Under Triton's interpreter the
products are summed by ``tl.sum`` instead of ``tl.dot``.

Layouts: stream ``[T, hc, D]`` bf16 with ``[hc, D]`` contiguous per token; fn ``[(2 + hc) * hc, hc *
D]`` fp32, rows contiguous; partials ``[T, slices, PARTIAL_COLS]`` fp32 (column ``(2 + hc) * hc``:
the sum of squares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_sinkhorn
from .triton_common import INTERPRETED

SPLIT_K = 512  # stream columns per program: V4.1-Flash's 20,480 make 40 slices, enough programs for one token
BLOCK_K = 64  # columns per step
BLOCK_T = 64  # tokens per program, at every T: one tensor-core instruction shape (the rows' sums never change)
PARTIAL_COLS = 32  # the (2 + hc) * hc = 24 mixes of hc = 4, their sum of squares, padding
# the pipeline's depth (steps whose loads are in flight; the bits do not depend on it). One H100
# (``benchmarks/small_kernels.py``, a call with its Sinkhorn, 1 / 16 / 64 tokens): 3 stages 11.8-12.1 µs,
# 2 stages ~1 µs slower, 4 and 8 within 0.3 µs (docs/benchmarks-log.md)
STAGES = 3


@triton.jit
def _top_8_bits(v):
    """``v`` with its significand cut to its top 8 bits: an fp32 value that bf16 holds exactly."""
    return (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split_bf16(w):
    """fp32 ``w`` as three bf16 parts whose sum is exactly ``w``: its significand's top 8 bits, the next
    8 and the last 8 (each remainder is exact in fp32), so three bf16 products of an exact bf16 ``x``
    add up to ``x * w``. The cuts are made on the bits, so they do not depend on how a conversion
    rounds (Triton's interpreter truncates where the GPU rounds to nearest)."""
    high = _top_8_bits(w)
    rest = w - high
    middle = _top_8_bits(rest)
    return high.to(tl.bfloat16), middle.to(tl.bfloat16), (rest - middle).to(tl.bfloat16)


@triton.jit
def _mix_partials_kernel(x_ptr, fn_ptr, part_ptr, T, K, stride_x, stride_fn, stride_pt,
                         MIXES: tl.constexpr, COLS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    mix = tl.arange(0, COLS)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_T, COLS), dtype=tl.float32)
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(pid_s * SPLIT_K, pid_s * SPLIT_K + SPLIT_K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(fn_ptr + mix[None, :] * stride_fn + offs_k[:, None], mask=(mix[None, :] < MIXES) & k_mask[:, None],
                    other=0.0)  # [BLOCK_K, COLS]: fn's slice, transposed
        high, middle, low = _split_bf16(w)
        xf = x.to(tl.float32)
        if INTERPRETED:  # 16-bit dot operands are multiplied wrongly there; the same exact products in fp32
            acc += tl.sum(xf[:, :, None] * high.to(tl.float32)[None, :, :], axis=1)
            acc += tl.sum(xf[:, :, None] * middle.to(tl.float32)[None, :, :], axis=1)
            acc += tl.sum(xf[:, :, None] * low.to(tl.float32)[None, :, :], axis=1)
        else:  # one step's products summed on the tensor cores, then added to the total in fp32 (see above)
            step = tl.dot(x, high)
            step = tl.dot(x, middle, step)
            acc += tl.dot(x, low, step)
        squares += tl.sum(xf * xf, axis=1)
    acc = tl.where(mix[None, :] == MIXES, squares[:, None], acc)
    out = part_ptr + rows.to(tl.int64)[:, None] * stride_pt + pid_s * COLS + mix[None, :]
    tl.store(out, acc, mask=row_mask[:, None])


def mix_partials(stream: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """Partial sums ``[T, slices, PARTIAL_COLS]`` fp32 (module docstring)."""
    t = stream.shape[0]
    x = stream.flatten(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    mixes, k = fn.shape
    assert x.shape[1] == k and mixes < PARTIAL_COLS, (tuple(x.shape), tuple(fn.shape))
    fn = fn.float().contiguous()
    slices = triton.cdiv(k, SPLIT_K)
    partials = torch.empty(t, slices, PARTIAL_COLS, dtype=torch.float32, device=stream.device)
    if t:
        _mix_partials_kernel[(triton.cdiv(t, BLOCK_T), slices)](
            x, fn, partials, t, k, x.stride(0), fn.stride(0), partials.stride(0), MIXES=mixes, COLS=PARTIAL_COLS,
            BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, INTERPRETED=INTERPRETED, num_warps=4,
            num_stages=STAGES)
    return partials


def hc_coefficients(stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                    iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream ``[T, hc, D]`` -> pre ``[T, hc]``, post ``[T, hc]``, comb ``[T, hc, hc]`` fp32 (module docstring)."""
    partials = mix_partials(stream, fn)
    return triton_sinkhorn.split_sinkhorn(partials, fn.shape[1], norm_eps, scale, base, hc, iters, hc_eps)
