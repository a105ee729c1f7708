"""Decode form of the products: a few tokens, the weight streamed by many programs.

One kernel (``_decode_mm_kernel``: bf16 operands, the weight expanded in registers) with two entry
points, for the small M of decode steps, where the weight's bytes are the whole cost (the FP8 linears
of 3-256 tokens outside the batch-invariant mode; one or two tokens take ``triton_gemv``). Each launch
reads its config from the table by M, or from its own rows by shape (``tile_configs.fp8_decode_config``,
``decode_mm_config``):

* ``fp8_decode_mm``: the FP8 linears (``quantized_linear``: the activation's FP8 round trip per 32
  times an FP8 weight). Both scales are folded into bf16 operands, as in the prefill form
  (``triton_bf16_mm``): the round trip is computed once per call (``act_quant_bf16``: each value
  times its block's scale, exact in bf16; in the model the kernel that makes the input computes it,
  ``rounded``: FP8-ready rows, ``backend.py``), each weight tile is expanded with its 32x32 scales (exact:
  an e4m3 value times a power of two), and the tensor cores sum the exact products of a whole step
  in fp32. Every product is the reference's; only the order of the fp32 sums differs (within one
  bf16 ulp of the reference's result, tested). Until d2a7a5e it kept the reference's block order:
  the unscaled e4m3 values (as fp16) multiplied one 32-column block per step, each block's sums
  times its two scales added to the row's. That rescale of the whole ``[rows, tokens]`` sum every
  32 columns cost more than the folded expansion from 16 tokens up: on one H100 the folded form took
  four of the layer's shapes (``wo_b``, ``wq_b``, ``w1``, ``wkv``) 118.4 -> 99.6 µs at 64 tokens
  and 85.7 -> 73.7 µs at 16 (``docs/benchmarks-log.md``). Tried before and not kept: e4m3 products on
  the FP8 tensor cores (their sums inside a 32-column block are not exact: 0.5-1.4% of outputs moved
  by more than one bf16 ulp); the round trip taken in this kernel's loop (every row tile and split
  rounds the activation again), the weight expanded one 32-column block at a time, and the expansion
  through bf16 instead of fp32 (fewer instructions, slower): all three slower on one H100 at 16-256
  tokens (``docs/benchmarks-log.md``).
  Two projections of one input (``quantized_linears``: ``wq_a`` and ``wkv``, the two ``wq_b``, the
  shared expert's ``w1`` and ``w3``) take one round trip and one launch: the second weight's row tiles
  follow the first's in the grid, its outputs the first's columns, as in the matrix-vector form (``triton_gemv``).
* ``decode_mm``: the other bf16-operand products (the grouped ``wo_a`` with its bf16 activation,
  the bf16 head), what ``triton_bf16_mm.bf16_mm`` computes, with the weight tile expanded to bf16;
  ``round_trip``: the output's FP8 round trip instead, taken where the splits are added (``wo_a``'s
  output as FP8-ready rows for ``wo_b``).

Both take the products transposed and split K:

* operands swapped (``C^T = W a^T``): weight rows fill the tensor cores' 64-row side, the tokens
  (16 to 256, padded to a power of two) the narrow side, so no instruction row is wasted on absent tokens
  and each weight tile is expanded once for all of them;
* split-K: K is cut into ``splits`` equal ranges so that there are a few programs per SM even for
  the narrow matrices (``wkv`` has 4 tiles of 128 rows). A program alone on its SM streams too little:
  leaving K whole where a launch has about an SM's worth of row tiles (``wo_b``'s 80, so no split sums'
  launch) took 1.4-2.4x as long per launch on one H100 (``docs/benchmarks-log.md``). Each program writes its
  fp32 partial sums; ``_sum_splits_kernel`` adds them in split order (deterministic: the same inputs give
  the same bits on every run) and rounds once. One split writes the output directly. (Letting the last split
  of each tile to arrive add the partials, with a counter per tile, saved that launch but was
  slower on one H200 at 8 and 64 tokens: one program per tile then reads every split's partial in
  turn. Tried again for 64-row tiles of 16 tokens, four splits' loads at a time as ``triton_gemv``
  adds them: a layer's projections took 100.8 µs against 98.6 on one H100; ``docs/benchmarks-log.md``.)

Not batch invariant: the split, and the summation order it implies, depend on the shape, and the
prefill form (``bf16_mm``) sums K in one pass. ``TritonKernels(batch_invariant=True)`` therefore
uses ``bf16_mm`` at every M.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..config import WeightFormat
from .tile_configs import DecodeConfig, decode_mm_config, fp8_decode_config
from .triton_common import INTERPRETED, bf16_exact, fp8_round_trip_groups, fp8_round_trip_row, sm_count, to_bf16
from .triton_dependent_launch import fetch_into_l2, launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_scaled_mm import act_quant_bf16
from .triton_weight_tiles import FORMAT_CODES, row_exponents, scale_words, scaled_rows

# the kernel takes M <= this (one token tile); which products take it up to which M is the tables' last
# bound (``tile_configs.decode_form_max_tokens``)
MAX_TOKENS = 256


@triton.jit
def _decode_mm_kernel(a_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, out_ptr, M, N, N2, K, k_per_split,
                      stride_am, stride_ag, stride_wn, stride_wg, stride_sn, stride_sg, stride_os, stride_om,
                      B_FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SCALE_WORDS: tl.constexpr, PARTIAL: tl.constexpr,
                      OUT_F32: tl.constexpr, ROUND_TRIP: tl.constexpr, LINE: tl.constexpr, FETCH_LINES: tl.constexpr,
                      PDL: tl.constexpr, EXACT_DOT: tl.constexpr):
    pid_w, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the first weight's row tiles (of this group), then the second's, whose outputs follow the first's
    tiles = tl.cdiv(N, BLOCK_W)
    if pid_w < tiles:
        weights, scales, tile, first_col, n = w_ptr + group * stride_wg, s_ptr + group * stride_sg, pid_w, group * N, N
    else:
        weights, scales, tile, first_col, n = w2_ptr, s2_ptr, pid_w - tiles, N, N2
    offs_w = tile * BLOCK_W + tl.arange(0, BLOCK_W)  # output features (weight rows)
    offs_t = tl.arange(0, BLOCK_T)  # tokens
    a_ptr += group * stride_ag
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    k_begin = split * k_per_split
    # with PDL: the first steps' weight fetched into L2 while the previous kernel finishes (no kernel of a step
    # writes a weight), then the wait (the activation and the outputs may be the previous kernel's)
    _fetch_first_lines(weights, offs_w, n, k_begin, tl.minimum(k_begin + k_per_split, K), stride_wn, LINE,
                       FETCH_LINES, PDL)
    wait_for_previous_kernel(PDL)
    # the last split may reach past K: its loop stops there, so with EVEN_K every step is whole and its
    # loads need no column mask (one would cut them into single bytes the compiler cannot stream ahead)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_mask = offs_t[:, None] < M
        a = tl.load(a_ptr + offs_t[:, None] * stride_am + offs_k[None, :],
                    mask=a_mask if EVEN_K else a_mask & (offs_k[None, :] < K), other=0.0)
        exponents = row_exponents(scales, offs_w, k0, n, K, stride_sn, B_FMT, BLOCK_W, BLOCK_K, SCALE_WORDS)
        w = scaled_rows(weights, exponents, offs_w, k0, n, K, stride_wn, B_FMT, BLOCK_W, BLOCK_K, EVEN_K, EXACT_DOT)
        if EXACT_DOT:  # the interpreter multiplies 16-bit dot operands wrongly; fp32 gives the same exact products
            acc = tl.dot(w.to(tl.float32), tl.trans(a).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(a), acc)
    let_next_kernel_start(PDL)  # (its programs then fetch their first weights while this one stores)
    cols = first_col + offs_w  # the output's columns: groups (or the two weights) side by side
    mask = (offs_t[None, :] < M) & (offs_w[:, None] < n)
    out_ptr += split * stride_os + offs_t[None, :] * stride_om + cols[:, None]
    if PARTIAL or OUT_F32:
        tl.store(out_ptr, acc, mask=mask)
    else:
        out = to_bf16(acc, EXACT_DOT)
        if ROUND_TRIP:  # one split: the FP8 round trip per 32 features here (a tile holds whole groups of them)
            out = tl.trans(fp8_round_trip_groups(bf16_exact(tl.trans(out)), BLOCK_T, BLOCK_W)).to(tl.bfloat16)
        tl.store(out_ptr, out, mask=mask)


@triton.jit
def _fetch_first_lines(weights, offs_w, n, k_begin, k_end, stride_wn, LINE: tl.constexpr, FETCH_LINES: tl.constexpr,
                       PDL: tl.constexpr):
    """With PDL, the first ``FETCH_LINES`` 128-byte lines (``LINE`` elements each) of the program's weight rows
    in its split fetched into L2 (rows past ``n`` and columns past the split's end clamped in)."""
    if PDL:
        lines = tl.arange(0, FETCH_LINES)
        cols = tl.minimum(k_begin + lines * LINE, k_end - 1)
        rows = tl.minimum(offs_w, n - 1)
        fetch_into_l2(weights + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], PDL)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, OUT_F32: tl.constexpr, ROUND_TRIP: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr, EXACT_DOT: tl.constexpr):
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):  # split order: the same bits on every run
        total += tl.load(part_ptr + split * numel + offs, mask=mask, other=0.0)
    if OUT_F32:
        tl.store(out_ptr + offs, total, mask=mask)
    else:
        out = to_bf16(total, EXACT_DOT)
        if ROUND_TRIP:  # rows of a multiple of 32 columns: a block is whole groups (past numel: zeros, not stored)
            out = fp8_round_trip_row(out, BLOCK)
        tl.store(out_ptr + offs, out, mask=mask)


SHARED_MEMORY_BYTES = 200 * 1024  # of the 227 KiB an H100/H200 block may use: room for the compiler's own


def fit_shared_memory(cfg: DecodeConfig, weight_bytes: int, block_t: int) -> DecodeConfig:
    """``cfg`` with ``block_k`` halved until the pipeline's buffers (``num_stages`` weight and activation
    tiles) fit in shared memory: the tables are tuned for FP8 weights, the bf16 head takes twice the bytes."""
    while cfg.block_k > 64 and cfg.num_stages * cfg.block_k * (cfg.block_w * weight_bytes + block_t * 2) > SHARED_MEMORY_BYTES:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


LINE_BYTES = 128  # a cache line


def fetch_lines(cfg: DecodeConfig, element_bytes: int) -> int:
    """Lines per weight row that a program fetches into L2 before its wait (with PDL): what the pipeline's
    first ``num_stages - 1`` steps read, a power of two."""
    return triton.next_power_of_2(max(1, (cfg.num_stages - 1) * cfg.block_k * element_bytes // LINE_BYTES))


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


def _sum_splits(partials: torch.Tensor, out: torch.Tensor, round_trip: bool, pdl: bool) -> torch.Tensor:
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](partials, out, numel, SPLITS=partials.shape[0],
                                                     OUT_F32=out.dtype == torch.float32, ROUND_TRIP=round_trip,
                                                     BLOCK=block, EXACT_DOT=INTERPRETED, num_warps=4,
                                                     **launch_arguments(pdl, out.device))
    return out


def _check_rows(m: int) -> None:
    if m > MAX_TOKENS:
        raise ValueError(f"the decode form takes at most {MAX_TOKENS} rows, got {m}")


def fp8_decode_mm(a: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  rounded: bool = False, pdl: bool = False) -> torch.Tensor:
    """``a [M, K]`` bf16 (M <= ``MAX_TOKENS``, K a multiple of 32) through its FP8 round trip per 32,
    times one or two FP8 weights ``(values [N, K], scales [N/32, K/32])`` (UE8M0 scales) -> ``[M, N (+ N2)]``
    bf16, the second weight's outputs after the first's: two projections of one input in one launch.
    ``rounded``: ``a`` is that round trip already (its producer computed it), so no launch rounds it;
    ``pdl``: the product and its split sums by programmatic dependent launch (``decode_mm``)."""
    m, k = a.shape
    _check_rows(m)
    if k % 32:
        raise ValueError(f"FP8 linears take K a multiple of 32, got {k}")
    (values, scales), second = weights[0], weights[1:]
    return decode_mm(a if rounded else act_quant_bf16(a.contiguous(), pdl=pdl), values, scales, WeightFormat.FP8,
                     cfg=fp8_decode_config(m, sum(v.shape[0] for v, _ in weights), k),
                     second=second[0] if second else None, pdl=pdl)


def decode_mm(a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, fmt: WeightFormat,
              groups: int = 1, out_dtype: torch.dtype = torch.bfloat16, cfg: DecodeConfig | None = None,
              second: tuple[torch.Tensor, torch.Tensor | None] | None = None, round_trip: bool = False,
              pdl: bool = False) -> torch.Tensor:
    """``a [M, G*K]`` bf16 (M <= ``MAX_TOKENS``; group g reads columns g*K..) times ``W [G*N, K]``
    (FP8 expanded with its scales, or BF16 with ``scales`` None) -> ``[M, G*N]`` in ``out_dtype``;
    ``cfg``: the config (default: ``decode_mm_config``'s for this launch); ``second``: a second weight ``(values [N2, K],
    scales)`` of the same format times the same ``a`` (one group), its outputs in columns N..N+N2;
    ``round_trip``: the bf16 output's FP8 round trip per 32 instead (rows of a multiple of 32), taken
    where the splits are added (one split: in the product's own epilogue). ``pdl``: programmatic dependent launch where
    the GPU has it (``triton_dependent_launch``): each program fetches its first steps' weight into L2
    before it waits for the previous kernel, and lets the next start once its weight is streamed; the
    split sums wait first."""
    m = a.shape[0]
    k = a.shape[1] // groups
    n = values.shape[0] // groups
    n2 = second[0].shape[0] if second is not None else 0
    _check_rows(m)
    if round_trip and (out_dtype != torch.bfloat16 or n % 32 or n2 % 32):
        raise ValueError(f"the FP8 round trip takes bf16 rows of whole groups of 32 per weight, got {out_dtype} "
                         f"rows of {n} (+ {n2})")
    if second is not None:
        values, scales, second = _pair_operands(values, scales, second, k, groups)
    out = torch.empty(m, groups * n + n2, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    block_t = max(16, triton.next_power_of_2(m))
    cfg = fit_shared_memory(cfg or decode_mm_config(m, groups * n + n2, k), values.element_size(), block_t)
    splits, k_per_split = split_count(cfg, n + n2, k, groups, sm_count(a.device))
    if fmt is WeightFormat.BF16:
        w, s, scale_rows_per_group = values, values, 0
        w2 = s2 = second[0] if second is not None else w
    else:
        w, s = values.view(torch.uint8), scales.view(torch.uint8)
        w2, s2 = (second[0].view(torch.uint8), second[1].view(torch.uint8)) if second is not None else (w, s)
        scale_rows_per_group = n // 32
    partial = splits > 1
    width = groups * n + n2
    target = torch.empty(splits, m, width, dtype=torch.float32, device=a.device) if partial else out
    tiles = triton.cdiv(n, cfg.block_w) + triton.cdiv(n2, cfg.block_w)
    words = fmt is not WeightFormat.BF16 and scale_words(s, k, cfg.block_k) and scale_words(s2, k, cfg.block_k)
    _decode_mm_kernel[(tiles, splits, groups)](
        a, w, s, w2, s2, target, m, n, n2, k, k_per_split,
        a.stride(0), k, w.stride(0), n * w.stride(0), s.stride(0), scale_rows_per_group * s.stride(0),
        m * width if partial else 0, width,
        B_FMT=FORMAT_CODES[fmt], BLOCK_T=block_t, BLOCK_W=cfg.block_w, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, SCALE_WORDS=words, PARTIAL=partial, OUT_F32=out_dtype == torch.float32,
        ROUND_TRIP=round_trip and not partial,
        LINE=LINE_BYTES // values.element_size(), FETCH_LINES=fetch_lines(cfg, values.element_size()),
        EXACT_DOT=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_arguments(pdl, a.device))
    return _sum_splits(target, out, round_trip, pdl) if partial else out


def _pair_operands(values: torch.Tensor, scales: torch.Tensor | None, second: tuple[torch.Tensor, torch.Tensor | None],
                   k: int, groups: int):
    """A pair's two weights (and scales) contiguous: the kernel steps through the rows of both with one stride."""
    if groups != 1 or values.shape[1] != k or second[0].shape[1] != k:
        raise ValueError(f"a pair of weights takes one group and the same K, got {groups} groups, "
                         f"K = {values.shape[1]} and {second[0].shape[1]}")
    values, scales, *second = (t.contiguous() if t is not None else None for t in (values, scales, *second))
    return values, scales, tuple(second)
