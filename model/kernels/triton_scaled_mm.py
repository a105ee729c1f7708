"""Triton kernel of the FP4 products: the routed experts' building blocks, and FP4 linears.

``scaled_mm(q, q_scales, W)``: the activation arrives as its e4m3 values (held in fp16, which
represents every e4m3 value exactly) with one fp32 power-of-two scale per row and 32-block
(``act_quant``); the weight is read in its storage format. For every 32-wide K block the kernel
forms the block's partial product on the tensor cores from the unscaled values (every product is
exact) and adds it to an fp32 accumulator times the activation's and the weight's scales: the
reference's own order of operations (``model/gemm.py::block_scaled_linear``), with only the
32-term sums inside a block left to the tensor cores.

Layouts: ``q [M, K]`` fp16, ``q_scales [M, K/32]`` fp32; FP8 weight ``[N, K]`` e4m3 bytes with
``[ceil(N/32), K/32]`` UE8M0 tile scales; FP4 weight ``[N, K/2]`` bytes (element 2k in the low
nibble) with ``[N, K/32]`` UE8M0 scales. Output ``[M, N]`` bf16.

Operand roles are swapped (``C^T = W q^T``): weight rows fill the tensor cores' 64-row side, so a
decode step of a few tokens wastes no rows, and the weight block goes from registers (where it is
expanded) straight into the instruction. Scaling the fp32 partials instead of every weight element
keeps the FP4 expansion to a few integer operations per value (the MoE's bottleneck); for FP8
weights ``triton_bf16_mm`` measured faster (see there), so dense FP8 linears go there. Batch invariance by construction: a program owns whole
output elements and walks K in 32-blocks from 0 (no split-K), and every tile config keeps the
same instruction shape (``tile_configs.py``), so a row's result never depends on M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import scaled_mm_config
from .triton_common import INTERPRETED, fp8_round_trip_groups, quantize_groups_of_32, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_weight_tiles import FORMAT_CODES, e2m1_bytes_to_fp16, fragment_column


@triton.jit
def weight_block(w_ptr, offs_w, k0, N, stride_wn, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """fp16 ``[BLOCK_W, 32]``: the unscaled values of weight rows ``offs_w``, columns ``k0..k0+31``.

    FP8: e4m3 values (exact in fp16). FP4: e2m1 values times 2**-14: the 4-bit code (s, e1 e0, m)
    placed in fp16's sign and lowest exponent/mantissa bits is exactly that, subnormals included;
    ``weight_scale`` folds the 2**14 back in.
    """
    row_mask = offs_w[:, None] < N
    if B_FMT == 0:
        raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + (k0 + tl.arange(0, 32))[None, :], mask=row_mask, other=0)
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + (k0 // 2 + tl.arange(0, 16))[None, :], mask=row_mask,
                  other=0)
    low, high = e2m1_bytes_to_fp16(raw, INTERPRETED)
    return tl.reshape(tl.join(low, high), (BLOCK_W, 32))  # low nibble first


@triton.jit
def weight_scale(s_ptr, offs_w, block, N, stride_sn, B_FMT: tl.constexpr):
    """fp32 ``[BLOCK_W]``: the scale of each row in K block ``block`` (FP4: times 2**14, see above)."""
    row = offs_w // 32 if B_FMT == 0 else offs_w
    exponent = tl.load(s_ptr + row * stride_sn + block, mask=offs_w < N, other=0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
    if B_FMT == 1:
        scale = scale * 16384.0
    return scale


@triton.jit
def scaled_block_dot(acc, w, a, w_scale, a_scale, INTERPRETED: tl.constexpr):
    """``acc + (w @ a) * w_scale x a_scale``: one 32-block's partial product, scaled, accumulated."""
    if INTERPRETED:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
        part = tl.dot(w.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(w, a)
    return acc + part * w_scale[:, None] * a_scale[None, :]


@triton.jit
def activation_block(q_ptr, qs_ptr, rows, row_mask, k0, stride_q, stride_qs):
    """(fp16 ``[32, len(rows)]``, fp32 ``[len(rows)]``): the e4m3 values of columns ``k0..k0+31`` of
    the given activation rows, transposed for the product, and the rows' scales of that block."""
    a = tl.load(q_ptr + rows[None, :] * stride_q + (k0 + tl.arange(0, 32))[:, None], mask=row_mask[None, :], other=0.0)
    return a, tl.load(qs_ptr + rows * stride_qs + k0 // 32, mask=row_mask, other=0.0)


@triton.jit
def accumulate_block(acc, w_ptr, s_ptr, offs_w, k0, N, stride_wn, stride_sn, a, a_scale, B_FMT: tl.constexpr,
                     BLOCK_W: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc`` plus the scaled partial product of K block ``k0`` of weight rows ``offs_w`` and ``a``."""
    w = weight_block(w_ptr, offs_w, k0, N, stride_wn, B_FMT, BLOCK_W, INTERPRETED)
    w_scale = weight_scale(s_ptr, offs_w, k0 // 32, N, stride_sn, B_FMT)
    return scaled_block_dot(acc, w, a, w_scale, a_scale, INTERPRETED)


@triton.jit
def _scaled_mm_kernel(q_ptr, qs_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, stride_qm, stride_qsm, stride_wn, stride_wsn,
                      stride_cm, B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    pid_w, pid_t = tl.program_id(0), tl.program_id(1)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # output features (weight rows)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # tokens
    t_mask = offs_t < M
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, 32):
        a, a_scale = activation_block(q_ptr, qs_ptr, offs_t, t_mask, k0, stride_qm, stride_qsm)
        acc = accumulate_block(acc, w_ptr, ws_ptr, offs_w, k0, N, stride_wn, stride_wsn, a, a_scale, B_FMT, BLOCK_W,
                               INTERPRETED)
    tl.store(c_ptr + offs_t[None, :] * stride_cm + offs_w[:, None], to_bf16(acc, INTERPRETED),
             mask=t_mask[None, :] & (offs_w[:, None] < N))


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr, ROUND_TRIP: tl.constexpr, FRAGMENT_COLUMNS: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROUND_TRIP:  # values times scales, in bf16 (exact)
        y = fp8_round_trip_groups(x, BLOCK_ROWS, BLOCK_COLS)
        places = fragment_column(cols) if FRAGMENT_COLUMNS else cols
        tl.store(q_ptr + rows[:, None] * stride_q + places[None, :], y.to(tl.bfloat16), mask=mask)
    else:
        q, scale = quantize_groups_of_32(x, BLOCK_ROWS, BLOCK_COLS)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(tl.float16), mask=mask)
        blocks = tl.program_id(1) * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
        tl.store(s_ptr + rows[:, None] * stride_s + blocks[None, :], scale,
                 mask=(rows[:, None] < M) & (blocks[None, :] < K // 32))


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[M, K]`` -> (e4m3 values as fp16 ``[M, K]``, fp32 scales ``[M, K/32]``), the reference's
    ``act_quant`` bit for bit (UE8M0 scale read off the fp32 bits, round to nearest even, saturating)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float16, device=x.device)
    s = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    _launch_act_quant(x, q, s, round_trip=False)
    return q, s


def act_quant_bf16(x: torch.Tensor, fragment_columns: bool = False, pdl: bool = False) -> torch.Tensor:
    """bf16 ``[M, K]`` -> its FP8 round trip per 32, in bf16 (exact): ``fp8_qdq`` bit for bit;
    ``fragment_columns``: each row's columns in the fragment layout's order (``fragment_column``, K a
    multiple of 64), as ``triton_mma_experts`` reads them; ``pdl``: programmatic dependent launch where
    the GPU has it (``triton_dependent_launch``)."""
    if fragment_columns and x.shape[1] % 64:
        raise ValueError(f"the fragment layout's column order needs K % 64 == 0, not {x.shape[1]}")
    y = torch.empty_like(x)
    _launch_act_quant(x, y, y, round_trip=True, fragment_columns=fragment_columns, pdl=pdl)
    return y


def _launch_act_quant(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, round_trip: bool,
                      fragment_columns: bool = False, pdl: bool = False) -> None:
    m, k = x.shape
    if m:
        rows, cols = 4, 512
        _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, cols))](
            x, out, scales, m, k, x.stride(0), out.stride(0), scales.stride(0), BLOCK_ROWS=rows, BLOCK_COLS=cols,
            ROUND_TRIP=round_trip, FRAGMENT_COLUMNS=fragment_columns, num_warps=4, **launch_arguments(pdl, x.device))


def scaled_mm(q: torch.Tensor, q_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              fmt: WeightFormat) -> torch.Tensor:
    """``act_quant`` output ``[M, K]`` times a stored FP8/FP4 weight ``[N, K]`` -> bf16 ``[M, N]``."""
    m, k = q.shape
    n = values.shape[0]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    if m == 0:
        return c
    cfg = scaled_mm_config(m)
    w, s = values.view(torch.uint8), scales.view(torch.uint8)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _scaled_mm_kernel[grid](q, q_scales, w, s, c, m, n, k, q.stride(0), q_scales.stride(0), w.stride(0), s.stride(0),
                            c.stride(0), B_FMT=FORMAT_CODES[fmt], BLOCK_T=cfg.block_m, BLOCK_W=cfg.block_n,
                            INTERPRETED=INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c
