"""Triton kernel of Engram's gated add (twin: ``model.engram.engram_gate``).

For each token and each of its ``hc`` stream copies ``h`` (a row of ``D`` values), with the
looked-up key ``k`` for that copy and the token's value ``v``:

    rstd = rsqrt(mean(h^2) + eps) * rsqrt(mean(k^2) + eps)
    dot  = sum(h * w * k) * rstd / sqrt(D)              (w: the copy's row of q_weight * k_weight)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))
    out  = bf16(h + gate * v)

all in fp32, as the twin. In torch this is ~15 kernels over fp32 copies of ``[T, hc, D]`` (the
stream, the key, their squares, the products): ~4 ms per Engram layer in an 8K-token prefill, and
15 launches per layer in a decode step. Here one program owns one (token, copy) row: a first pass
over the row in ``BLOCK`` chunks keeps the three sums as ``BLOCK``-wide fp32 vectors and adds
their lanes once at the end (a fixed order: a row's result depends only on the row, so it is batch
invariant and the same on every run); a second pass writes the output. Against the twin the order
of the three fp32 sums differs, and ``exp``/``rsqrt`` may come from another library: the gate moves
by a few fp32 ulps (more where ``dot`` is near zero), which moves an output by one bf16 ulp at times
and, where ``h`` and ``gate * v`` nearly cancel, by up to ~2e-6 |v| (``tests/test_triton_engram.py``
states the bound).

Layouts: ``stream [T, hc, D]`` bf16 contiguous; ``key [T, hc * D]`` and ``value [T, D]`` bf16 with
their own row strides (in the model the two column ranges of one ``kv``); ``weight [hc, D]`` fp32.
Output ``[T, hc, D]`` bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, exp_f32, to_bf16

BLOCK = 1024  # row chunk: D = 5120 is five chunks


@triton.jit
def _engram_gate_kernel(h_ptr, k_ptr, v_ptr, w_ptr, out_ptr, D, stride_k, stride_v, eps, clamp, inv_sqrt_d,
                        HC: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0)  # token * HC + copy
    token, copy = row // HC, row % HC
    h_row = h_ptr + row.to(tl.int64) * D
    k_row = k_ptr + token.to(tl.int64) * stride_k + copy * D
    w_row = w_ptr + copy * D
    offs = tl.arange(0, BLOCK)
    h_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    k_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    hwk = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        mask = d0 + offs < D
        h = tl.load(h_row + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_row + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_row + d0 + offs, mask=mask, other=0.0)
        h_sq += h * h
        k_sq += k * k
        hwk += (h * w) * k  # the twin's order: (h * w) * k
    rstd = tl.rsqrt(tl.sum(h_sq, axis=0) / D + eps) * tl.rsqrt(tl.sum(k_sq, axis=0) / D + eps)
    dot = tl.sum(hwk, axis=0) * rstd * inv_sqrt_d
    magnitude = tl.sqrt_rn(tl.maximum(tl.abs(dot), clamp))
    gate = tl.div_rn(1.0, 1.0 + exp_f32(-tl.where(dot < 0, -magnitude, magnitude), INTERPRETED))  # sigmoid
    v_row = v_ptr + token.to(tl.int64) * stride_v
    out_row = out_ptr + row.to(tl.int64) * D
    for d0 in range(0, D, BLOCK):
        mask = d0 + offs < D
        h = tl.load(h_row + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_row + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + d0 + offs, to_bf16(h + gate * v, INTERPRETED), mask=mask)


def engram_gate(stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float,
                clamp_value: float) -> torch.Tensor:
    """``stream [T, hc, D]`` bf16, ``key [T, hc * D]`` and ``value [T, D]`` bf16 (rows may be strided:
    the column ranges of ``kv.split``), ``weight [hc, D]`` fp32 -> the new stream ``[T, hc, D]`` bf16."""
    tokens, hc, dim = stream.shape
    stream = stream.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    out = torch.empty_like(stream)
    if tokens == 0:
        return out
    _engram_gate_kernel[(tokens * hc,)](stream, key, value, weight.float().contiguous(), out, dim, key.stride(0),
                                        value.stride(0), eps, clamp_value, dim ** -0.5, HC=hc,
                                        BLOCK=min(BLOCK, triton.next_power_of_2(dim)), INTERPRETED=INTERPRETED,
                                        num_warps=4, enable_fp_fusion=False)  # the twin's separate roundings
    return out
