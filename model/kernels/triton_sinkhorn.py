"""Triton kernel of mHC's coefficient split with Sinkhorn iterations (twin: ``model.mhc.split_sinkhorn``).

``split_sinkhorn(partials, k, norm_eps, scale, base, hc, iters, eps)``: each token's raw mixes
``[(2 + hc) * hc]`` fp32 become ``pre [hc]``, ``post [hc]`` and the doubly stochastic ``comb [hc,
hc]``, with the twin's arithmetic in its order: ``pre = sigmoid(m * scale[0] + base) + eps``, ``post = 2 * sigmoid(m *
scale[1] + base)``, ``comb`` a softmax over its last axis plus eps, then ``iters`` alternations of
column and row normalisation (the column first, each denominator plus eps).

Why a kernel: in torch the twin is ~135 tiny kernels per call (20 iterations of two sums and two
divisions on ``[T, 4, 4]``), two calls per layer, so a one-token decode step of an 8-layer model
spends more time launching them than anything else. Here one launch does a block of tokens, each
token's 24 values held in registers throughout.

Two tokens per program, one warp: one comb value per thread. The iterations are a serial chain
(two 4-value sums by shuffles, two IEEE divisions each), so a program's time is its warp's
instruction count times the latency between dependent instructions, nothing hides it. The first
version put 64 tokens on 4 warps (8 values per thread, 322 instructions per iteration): 15 µs for
a one-token decode step, twice per layer. With one value per thread an iteration is 43
instructions (SASS count). The block is the same at every T, so a token's bits never depend on the
batch; a long prefill fills the GPU with one-warp programs (up to 32 per SM).

The mixes never go through memory: the kernel reads the partial sums that ``triton_hc_coefficients``
writes per slice of the stream, adds a token's slices in increasing order and multiplies by
``rsqrt(sum of squares / k + norm_eps)`` (a correctly rounded square root and division) before the
split. (Its tests pass the twin's mixes as one slice whose sum of squares is 1, with ``k = 1`` and
``norm_eps = 0``: the rsqrt is then exactly 1.)

Layouts: partials ``[T, slices, cols]`` fp32, contiguous (column ``(2 + hc) * hc``: the sum of
squares), scale ``[3]`` and base ``[(2 +
hc) * hc]`` fp32; out pre ``[T, hc]``, post ``[T, hc]``, comb ``[T, hc, hc]`` fp32, contiguous.
``hc`` must be a power of two (V4.1: 4).

Arithmetic: fp32 fusion is off (the twin rounds each product and each sum), divisions are IEEE's
(``div_rn``) and ``exp`` is CUDA's ``expf``, what torch runs; ``sigmoid(x) = 1 / (1 + exp(-x))``,
torch's CUDA formula. The sums over four values may add in another order than torch's reduction,
so results can differ from the twin by a few fp32 ulps (``tests/test_triton_sinkhorn.py`` states
the tolerance). Each token is computed alone: no result depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, exp_f32

BLOCK_T = 2  # tokens per program: one comb value per thread (the module docstring says why)
NUM_WARPS = 1


@triton.jit
def _sigmoid(x, INTERPRETED: tl.constexpr):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x, INTERPRETED))


@triton.jit
def _slice_sum(row, offsets, mask, SLICES: tl.constexpr, COLS: tl.constexpr):
    """A token's partial sums at ``offsets`` added over its slices in increasing order (unrolled, so
    that every load is in flight at once)."""
    total = tl.load(row + offsets, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        total += tl.load(row + s * COLS + offsets, mask=mask, other=0.0)
    return total


@triton.jit
def _sinkhorn_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_pt, iters, eps,
                     K, norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, SLICES: tl.constexpr,
                     COLS: tl.constexpr, INTERPRETED: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    j = tl.arange(0, HC)
    row = part_ptr + offs_t.to(tl.int64) * stride_pt
    # the sum of squares, then rsqrt(mean + eps) as the twin computes it
    squares = _slice_sum(row, tl.full((BLOCK_T,), (2 + HC) * HC, tl.int32), t_mask, SLICES, COLS)
    squares = tl.where(t_mask, squares, 1.0)  # a padding token: no 1 / 0 when norm_eps is 0
    rsqrt = tl.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), tl.sqrt_rn(tl.div_rn(squares, K * 1.0) + norm_eps))

    vector_mask = t_mask[:, None]
    pre = _slice_sum(row[:, None], j[None, :], vector_mask, SLICES, COLS) * rsqrt[:, None]
    pre = _sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + j)[None, :], INTERPRETED) + eps
    post = _slice_sum(row[:, None], HC + j[None, :], vector_mask, SLICES, COLS) * rsqrt[:, None]
    post = 2.0 * _sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j)[None, :], INTERPRETED)

    square = j[:, None] * HC + j[None, :]  # [HC, HC]: comb[j, k] at 2 * HC + j * HC + k
    comb = _slice_sum(row[:, None, None], 2 * HC + square[None, :, :], t_mask[:, None, None], SLICES, COLS)
    comb = comb * rsqrt[:, None, None]
    comb = comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + square)[None, :, :]
    comb = exp_f32(comb - tl.max(comb, axis=2)[:, :, None], INTERPRETED)  # softmax over k ...
    comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None]) + eps  # ... plus eps
    comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + eps)  # the column normalisation first
    for _ in range(iters - 1):
        comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + eps)

    out = offs_t.to(tl.int64)
    tl.store(pre_ptr + out[:, None] * HC + j[None, :], pre, mask=vector_mask)
    tl.store(post_ptr + out[:, None] * HC + j[None, :], post, mask=vector_mask)
    tl.store(comb_ptr + out[:, None, None] * (HC * HC) + square[None, :, :], comb, mask=t_mask[:, None, None])


def split_sinkhorn(partials: torch.Tensor, k: int, norm_eps: float, scale: torch.Tensor, base: torch.Tensor,
                   hc: int, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre ``[T, hc]``, post ``[T, hc]``, comb ``[T, hc, hc]`` of the mixes whose partial sums are
    ``partials [T, slices, cols]`` (module docstring); ``k`` the stream's columns (the mean's divisor)."""
    t, slices, cols = partials.shape
    assert partials.is_contiguous(), "the kernel reads each token's slices at a stride of cols"
    pre = torch.empty(t, hc, dtype=torch.float32, device=partials.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=partials.device)
    if t == 0:
        return pre, post, comb
    _sinkhorn_kernel[(triton.cdiv(t, BLOCK_T),)](
        partials, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, partials.stride(0),
        iters, float(eps), k, float(norm_eps), HC=hc, BLOCK_T=BLOCK_T, SLICES=slices, COLS=cols,
        INTERPRETED=INTERPRETED, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return pre, post, comb
