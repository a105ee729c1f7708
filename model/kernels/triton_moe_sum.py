"""Triton kernels of the MoE layer's elementwise ends (twins: ``ReferenceKernels.swiglu`` and ``.moe_sum``).

``swiglu(gate, up, limit)``: the shared expert's activation, bf16 ``[N, I]`` twice -> bf16: in fp32,
``up`` clamped to ``[-limit, limit]`` and ``gate`` from above at ``limit`` (when ``limit > 0``), then
``silu(gate) * up`` with ``silu(g) = g / (1 + exp(g * -1))`` (torch's CUDA formula), rounded to bf16.
Torch takes seven kernels (two casts, two clamps, silu, the product, the cast back). ``fp8_ready``:
the result's FP8 round trip per 32 instead (``quant.fp8_qdq`` of the bf16 result, exactly), for the
down projection, which then skips the round trip's own launch (``KernelBackend.swiglu``).

``moe_sum(routed, ids, shared)``: a token's routed expert outputs ``routed [N, k, D]`` (bf16) summed in
fp32 in increasing expert id (``ids [N, k]``, distinct per token), from zero, then the shared
expert's output ``shared [N, D]`` added, rounded to bf16: the reference's order, bit for bit. Torch
takes ~k + 6 kernels (the argsort, the gather, the zeros, one addition per expert, the shared one,
the cast). Here a program holds a token's k rows of a block of features and adds the row of each
rank in turn (the row is picked by a masked sum, which adds only zeros to it: exact).

Every token (and feature block) is computed alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, exp_f32, fp8_round_trip_row, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel

BLOCK = 1024  # features per program


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, I, stride_g, stride_u, stride_o, limit, CLAMP: tl.constexpr,
                   ROUND_TRIP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)  # (the down projection then loads its first weights meanwhile)
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    silu = tl.div_rn(gate, 1.0 + exp_f32(gate * -1.0, INTERPRETED))
    y = to_bf16(silu * up, INTERPRETED)
    if ROUND_TRIP:  # (a block is whole groups of 32; the columns past I are zeros, never stored)
        y = fp8_round_trip_row(y, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _moe_sum_kernel(routed_ptr, ids_ptr, shared_ptr, out_ptr, D, stride_rt, stride_rk, stride_it, stride_st,
                    stride_ot, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.arange(0, K_POW2)
    col_mask = cols < D
    slot_mask = slots < K
    ids = tl.load(ids_ptr + t * stride_it + slots, mask=slot_mask, other=0x7FFFFFFF).to(tl.int64)
    other = tl.load(ids_ptr + t * stride_it + slots[:, None] * 0 + slots[None, :], mask=slot_mask[None, :],
                    other=0x7FFFFFFF).to(tl.int64)  # [K_POW2, K_POW2]: row s sees every id
    # rank of each slot in increasing id (ties, which routing never makes, by slot)
    before = (other < ids[:, None]) | ((other == ids[:, None]) & (slots[None, :] < slots[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    rows = tl.load(routed_ptr + t * stride_rt + slots[:, None] * stride_rk + cols[None, :],
                   mask=slot_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)  # [K_POW2, BLOCK]
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(K):
        total += tl.sum(tl.where(rank[:, None] == r, rows, 0.0), axis=0)
    total += tl.load(shared_ptr + t * stride_st + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, to_bf16(total, INTERPRETED), mask=col_mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, pdl: bool = False,
           round_trip: bool = False) -> torch.Tensor:
    """bf16 ``gate``, ``up`` ``[N, I]`` -> bf16 ``silu(clamped gate) * clamped up`` (module docstring);
    ``pdl``: programmatic dependent launch where the GPU has it (``triton_dependent_launch``);
    ``round_trip``: its FP8 round trip per 32 instead (I a multiple of 32)."""
    n, i = gate.shape
    if round_trip and i % 32:
        raise ValueError(f"the FP8 round trip takes rows of a multiple of 32, got {i}")
    out = torch.empty(n, i, dtype=torch.bfloat16, device=gate.device)
    if n:
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        up = up if up.stride(-1) == 1 else up.contiguous()
        _swiglu_kernel[(n, triton.cdiv(i, BLOCK))](
            gate, up, out, i, gate.stride(0), up.stride(0), out.stride(0), float(limit), CLAMP=limit > 0,
            ROUND_TRIP=round_trip, BLOCK=BLOCK, INTERPRETED=INTERPRETED, num_warps=4, enable_fp_fusion=False,
            **launch_arguments(pdl, gate.device))
    return out


def moe_sum(routed: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed ``[N, k, D]``, ids ``[N, k]``, shared ``[N, D]`` -> bf16 ``[N, D]`` (module docstring)."""
    n, k, d = routed.shape
    out = torch.empty(n, d, dtype=torch.bfloat16, device=routed.device)
    if n:
        routed = routed if routed.stride(-1) == 1 else routed.contiguous()
        ids = ids if ids.stride(-1) == 1 else ids.contiguous()
        shared = shared if shared.stride(-1) == 1 else shared.contiguous()
        _moe_sum_kernel[(n, triton.cdiv(d, BLOCK))](
            routed, ids, shared, out, d, routed.stride(0), routed.stride(1), ids.stride(0), shared.stride(0),
            out.stride(0), K=k, K_POW2=max(2, triton.next_power_of_2(k)), BLOCK=BLOCK, INTERPRETED=INTERPRETED,
            num_warps=4, enable_fp_fusion=False)
    return out
