"""Decode form of the products: a few tokens, the weight streamed by many programs.

Two kernels, for the small M of decode steps, where the weight's bytes are the whole cost:

* ``fp8_decode_mm``: the FP8 linears (``quantized_linear``: the activation's FP8 round trip per 32
  times an FP8 weight), in the reference's order (``model/gemm.py``'s ``block_scaled_linear``): per
  block of 32 columns, the products of the *unscaled* e4m3 values (exact in fp16, summed in fp32 by
  the tensor cores), times the activation's scale, times the weight's, added to the row's sum block
  after block. The activation's round trip is computed once per call (``act_quant``: e4m3 values
  in fp16 and their scales), not by every program at every step, and its values are loaded as the
  product's operand; the weight bytes go from shared memory to fp16 registers by one conversion
  per pair of values; the scales, which the compiler's pipeline does not load ahead (they are not
  product operands), are loaded one step ahead by hand. On one H200 this made a layer's eight FP8
  linears (in one CUDA graph) 124 -> 120 µs at one token and 252 -> 190 µs at 64, bit for bit the
  same results for the same split (``docs/benchmarks.md``). What else limits them: a fixed ~7-10 µs
  per linear (the quantization, the product and the split sum are three launches of ~2 µs each in a
  graph, plus the first loads' latency), while the 42 MB weights stream at ~2-3 TB/s. Tried and not
  kept: each program quantizing the bf16 blocks it reads (loaded one block ahead; the same bits) up
  to 16 tokens, which saved the 61 ``act_quant`` launches of a one-token step (106 -> 19 µs) but made
  its products 774 -> 992 µs on one H200; the weight through TMA descriptors with up to 8 stages (no faster), and e4m3 products on the
  FP8 tensor cores (12% faster, but their sums inside a 32-block are not exact: 0.5-1.4% of outputs
  moved by more than one bf16 ulp, against 0-0.003% here).
* ``decode_mm``: the other bf16-operand products (the grouped ``wo_a`` with its bf16 activation,
  the bf16 head), what ``triton_bf16_mm.bf16_mm`` computes, with the weight tile expanded to bf16.

Both take the products transposed and split K:

* operands swapped (``C^T = W a^T``): weight rows fill the tensor cores' 64-row side, the tokens
  (16 to 64, padded) the narrow side, so no instruction row is wasted on absent tokens;
* split-K: K is cut into ``splits`` equal ranges so that there are a few programs per SM even for
  the narrow matrices (``wkv`` has 4 tiles of 128 rows). Each program writes its fp32 partial sums;
  ``_sum_splits_kernel`` adds them in split order (deterministic: the same inputs give the same
  bits on every run) and rounds once. One split writes the output directly. (Letting the last split
  of each tile to arrive add the partials, with a counter per tile, saved that launch but was
  slower on one H200 at 8 and 64 tokens: one program per tile then reads every split's partial in
  turn; ``docs/benchmarks.md``.)

Not batch invariant: the split, and the summation order it implies, depend on the shape, and the
prefill form (``bf16_mm``) sums K in one pass. ``TritonKernels(batch_invariant=True)`` therefore
uses ``bf16_mm`` at every M.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import DecodeConfig, decode_mm_config, fp8_decode_config
from .triton_common import INTERPRETED, sm_count, to_bf16
from .triton_scaled_mm import act_quant
from .triton_weight_tiles import FORMAT_CODES, weight_rows

# the decode form takes M <= this (one token tile); at M = 256 it measured slower than the
# prefill form (the weight re-read per 64-token tile costs more than the split saves)
MAX_TOKENS = 64


@triton.jit
def _fp8_decode_mm_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                          stride_qm, stride_qsm, stride_wn, stride_sn, stride_os, stride_om,
                          BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, PARTIAL: tl.constexpr,
                          EXACT_DOT: tl.constexpr):
    pid_w, split = tl.program_id(0), tl.program_id(1)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # output features (weight rows)
    offs_t = tl.arange(0, BLOCK_T)  # tokens
    offs_c = tl.arange(0, 32)  # the columns of one scale block
    row_ok = offs_w < N
    t_ok = offs_t < M
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # the scales are not operands of the product, so the compiler's pipeline does not load them
    # ahead; each block's are loaded one block before they are used
    w_exp_next = tl.load(s_ptr + (offs_w // 32) * stride_sn + k_begin // 32, mask=row_ok, other=0)
    a_scale_next = tl.load(qs_ptr + offs_t * stride_qsm + k_begin // 32, mask=t_ok, other=0.0)
    for k0 in range(k_begin, k_end, 32):  # one scale block per step, in order
        w_exp, a_scale = w_exp_next, a_scale_next
        following = tl.minimum(k0 + 32, k_end - 32) // 32  # the last step reloads its own: always in range
        w_exp_next = tl.load(s_ptr + (offs_w // 32) * stride_sn + following, mask=row_ok, other=0)
        a_scale_next = tl.load(qs_ptr + offs_t * stride_qsm + following, mask=t_ok, other=0.0)
        # [32, T]: the activation's e4m3 values, loaded in the product's orientation
        q = tl.load(q_ptr + offs_t[None, :] * stride_qm + (k0 + offs_c)[:, None], mask=t_ok[None, :], other=0.0)
        raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + (k0 + offs_c)[None, :], mask=row_ok[:, None], other=0)
        w_scale = (w_exp.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
        if EXACT_DOT:  # the interpreter multiplies 16-bit dot operands wrongly; fp32: the same exact products
            part = tl.dot(raw.to(tl.float8e4nv, bitcast=True).to(tl.float32), q.to(tl.float32),
                          input_precision="ieee")
        else:  # e4m3 values are exact in fp16: one conversion per pair of bytes, no scale on the values
            part = tl.dot(raw.to(tl.float8e4nv, bitcast=True).to(tl.float16), q)
        acc += part * a_scale[None, :] * w_scale[:, None]  # the reference's order
    mask = t_ok[None, :] & row_ok[:, None]
    out_ptr += split * stride_os + offs_t[None, :] * stride_om + offs_w[:, None]
    if PARTIAL:
        tl.store(out_ptr, acc, mask=mask)
    else:
        tl.store(out_ptr, to_bf16(acc, EXACT_DOT), mask=mask)


@triton.jit
def _decode_mm_kernel(a_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                      stride_am, stride_ag, stride_wn, stride_wg, stride_sn, stride_sg, stride_os, stride_om,
                      B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, OUT_F32: tl.constexpr,
                      EXACT_DOT: tl.constexpr):
    pid_w, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # output features (weight rows of this group)
    offs_t = tl.arange(0, BLOCK_T)  # tokens
    a_ptr += group * stride_ag
    w_ptr += group * stride_wg
    s_ptr += group * stride_sg
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_t[:, None] * stride_am + offs_k[None, :],
                    mask=(offs_t[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = weight_rows(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, B_FMT, BLOCK_W, BLOCK_K,
                        False, EXACT_DOT)
        if EXACT_DOT:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
            acc = tl.dot(w.to(tl.float32), tl.trans(a).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(a), acc)
    cols = group * N + offs_w  # the output's columns: groups side by side
    mask = (offs_t[None, :] < M) & (offs_w[:, None] < N)
    out_ptr += split * stride_os + offs_t[None, :] * stride_om + cols[:, None]
    if PARTIAL or OUT_F32:
        tl.store(out_ptr, acc, mask=mask)
    else:
        tl.store(out_ptr, to_bf16(acc, EXACT_DOT), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, OUT_F32: tl.constexpr, BLOCK: tl.constexpr,
                       EXACT_DOT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):  # split order: the same bits on every run
        total += tl.load(part_ptr + split * numel + offs, mask=mask, other=0.0)
    if OUT_F32:
        tl.store(out_ptr + offs, total, mask=mask)
    else:
        tl.store(out_ptr + offs, to_bf16(total, EXACT_DOT), mask=mask)


SHARED_MEMORY_BYTES = 200 * 1024  # of the 227 KiB an H100/H200 block may use: room for the compiler's own


def fit_shared_memory(cfg: DecodeConfig, weight_bytes: int, block_t: int) -> DecodeConfig:
    """``cfg`` with ``block_k`` halved until the pipeline's buffers (``num_stages`` weight and activation
    tiles) fit in shared memory: the tables are tuned for FP8 weights, the bf16 head takes twice the bytes."""
    while cfg.block_k > 64 and cfg.num_stages * cfg.block_k * (cfg.block_w * weight_bytes + block_t * 2) > SHARED_MEMORY_BYTES:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def split_count(cfg: DecodeConfig, n: int, k: int, groups: int, sms: int) -> tuple[int, int]:
    """(splits, K columns per split): enough programs for ``cfg.programs_per_sm`` per SM (with
    ``cfg.one_wave``: as many splits as keep them within that many), each split a whole number of
    ``block_k`` steps."""
    tiles = triton.cdiv(n, cfg.block_w) * groups
    steps = triton.cdiv(k, cfg.block_k)
    wanted = (cfg.programs_per_sm * sms) // tiles if cfg.one_wave else triton.cdiv(cfg.programs_per_sm * sms, tiles)
    splits = max(1, min(steps, wanted, cfg.max_splits))
    steps_per_split = triton.cdiv(steps, splits)
    return triton.cdiv(steps, steps_per_split), steps_per_split * cfg.block_k


def _sum_splits(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](partials, out, numel, SPLITS=partials.shape[0],
                                                     OUT_F32=out.dtype == torch.float32, BLOCK=block,
                                                     EXACT_DOT=INTERPRETED, num_warps=4)
    return out


def _check_rows(m: int) -> None:
    if m > MAX_TOKENS:
        raise ValueError(f"the decode form takes at most {MAX_TOKENS} rows, got {m}")


def fp8_decode_mm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` bf16 (M <= ``MAX_TOKENS``, K a multiple of 32) through its FP8 round trip per 32,
    times the FP8 weight ``values [N, K]`` with its UE8M0 ``scales [N/32, K/32]`` -> ``[M, N]`` bf16."""
    m, k = a.shape
    n = values.shape[0]
    _check_rows(m)
    if k % 32:
        raise ValueError(f"FP8 linears take K a multiple of 32, got {k}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    q, q_scales = act_quant(a)  # once per call, not once per program and step
    block_t = max(16, triton.next_power_of_2(m))
    cfg = fp8_decode_config(m)
    while k % cfg.block_k:  # whole split units (the tables' units divide every V4.1 K)
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    splits, k_per_split = split_count(cfg, n, k, 1, sm_count(a.device))
    w, s = values.view(torch.uint8), scales.view(torch.uint8)
    target = torch.empty(splits, m, n, dtype=torch.float32, device=a.device) if splits > 1 else out
    _fp8_decode_mm_kernel[(triton.cdiv(n, cfg.block_w), splits)](
        q, q_scales, w, s, target, m, n, k, k_per_split, q.stride(0), q_scales.stride(0), w.stride(0), s.stride(0),
        m * n, n, BLOCK_T=block_t, BLOCK_W=cfg.block_w, PARTIAL=splits > 1, EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _sum_splits(target, out) if splits > 1 else out


def decode_mm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, fmt: WeightFormat,
              groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M, G*K]`` bf16 (M <= ``MAX_TOKENS``; group g reads columns g*K..) times ``W [G*N, K]``
    (FP8 expanded with its scales, or BF16 with ``scales`` None) -> ``[M, G*N]`` in ``out_dtype``."""
    m = a.shape[0]
    k = a.shape[1] // groups
    n = values.shape[0] // groups
    _check_rows(m)
    out = torch.empty(m, groups * n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    block_t = max(16, triton.next_power_of_2(m))
    cfg = fit_shared_memory(decode_mm_config(m), values.element_size(), block_t)
    splits, k_per_split = split_count(cfg, n, k, groups, sm_count(a.device))
    if fmt is WeightFormat.BF16:
        w, s, scale_rows_per_group = values, values, 0
    else:
        w, s = values.view(torch.uint8), scales.view(torch.uint8)
        scale_rows_per_group = n // 32
    partial = splits > 1
    target = torch.empty(splits, m, groups * n, dtype=torch.float32, device=a.device) if partial else out
    _decode_mm_kernel[(triton.cdiv(n, cfg.block_w), splits, groups)](
        a, w, s, target, m, n, k, k_per_split,
        a.stride(0), k, w.stride(0), n * w.stride(0), s.stride(0), scale_rows_per_group * s.stride(0),
        m * groups * n if partial else 0, groups * n,
        B_FMT=FORMAT_CODES[fmt], BLOCK_T=block_t, BLOCK_W=cfg.block_w,
        BLOCK_K=cfg.block_k, PARTIAL=partial, OUT_F32=out_dtype == torch.float32, EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _sum_splits(target, out) if partial else out
