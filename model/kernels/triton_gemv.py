"""One or two tokens' products with FP8 weights on the CUDA cores (the matrix-vector form of decode).

``fp8_gemv(x, [(values, scales), ...])``: one or two rows ``x [M, G*K]`` bf16 times one or two FP8 weights,
``values [G*N, K]`` e4m3 bytes with their ``scales [G*N/32, K/32]`` (UE8M0 per 32x32 tile) -> bf16
``[M, G*N (+ N2)]``. G groups side by side: the grouped ``wo_a`` (group g reads columns g*K..); two
weights: two projections of the same input in one launch (``wq_a`` and ``wkv``, the shared expert's
``w1`` and ``w3``), the second's outputs after the first's. With ``quantize`` the activation goes
through its FP8 round trip per 32 first (``quantized_linear``: the reference's ``act_quant``, bit for
bit); without, it is multiplied as it is (``grouped_dequantized_linear``).

Why a kernel for one token: the tensor-core decode form (``triton_decode_mm``) pads the token to 16
rows, walks K one 32-column scale block per step (4 KB of weight per step and program) and needs the
activation quantized by a launch of its own. At one token the bytes are everything: here each program
takes ``BLOCK_W`` rows x ``BLOCK_K`` columns of weight per step, its threads expand them to fp32 and
multiply on the CUDA cores; each program quantizes the activation columns it reads (hundreds of
values against thousands of weight bytes), so there is no ``act_quant`` launch. The weight is read as
int32 words and expanded by a few lines of PTX (``e4m3_words_to_f32``): 1.5 instructions per value
where the compiler's expansion of a byte tensor took ~5 (it moved every byte to a register of its own
and packed the pairs back for the conversion), and each thread keeps one sum per word it holds, not
one per byte, which took its registers from ~155 to ~53 (more programs fit an SM). On one H200 a
V4.1-Flash layer's nine FP8 projections (one CUDA graph) went 119 -> 81 µs and a one-token decode
step of the 8-layer config 3.03 -> 2.65 ms (``docs/benchmarks-log.md``); the loop spends ~5 instructions
per weight byte and thread, 2.5 of them the expansion and the product.

Two ways to bring the weight in (the config's ``num_stages``):
- at 1, each thread loads its words straight into registers, one step ahead of their use: one step in
  flight per program, a few KB, and the large projections streamed at 2.4-3.0 TB/s of an H200's 4.3
  that way. Loads two steps ahead were slower (90 instead of 81 µs: registers);
- at 2 or more (the default), the tensor memory accelerator copies each step's tile into a ring of that
  many tiles in shared memory (Triton's pipelining of a tensor descriptor's loads) and the threads read
  their words from there: up to ``num_stages - 1`` steps in flight with no register held for them. Steps
  of 512 columns and K split only until one program per SM (fewer split sums) then pay: on one H100 a
  layer's nine projections went 86.9 -> 78.6 µs (``tile_configs``). The ring's copies start only after
  the kernel's wait under programmatic dependent launch, so there each program first asks for its
  ring's first steps to be fetched into L2 (``_fetch_first_steps``), and lets the next kernel start
  once its own weight has streamed (76.4 against 78.5 µs without PDL, one H100).
The arithmetic and its order are the same either way (the same bits at the same config, tested). A
weight whose start is not 16-byte aligned (the accelerator's rule) takes the registers' way at
``tile_configs.GEMV_IN_REGISTERS``. Tried and not kept: with byte loads, persistent programs walking
several row tiles with their loads running ahead across tiles (the per-step work items' addressing and
fewer resident programs).

Arithmetic: every product of a (quantized) activation value and an e4m3 weight value is exact, and
so is it times the two block scales (powers of two), which go onto the activation; each thread adds
the products of each word's four bytes, in byte order, to that word position's fp32 sum over all of
K, then the program adds the sums. The reference sums each 32-block, scales it, then adds the blocks
in order: another fp32 order, within one bf16 ulp of the reference's result like the split-K decode
form (tested).

K is split so that enough programs stream the weight (``split_count``); the last split of each row
tile to arrive adds the tile's fp32 partials in split order and rounds once (``triton_split_sums``:
the same bits whichever program comes last), so a product is one launch.
Two rows (``TOKENS`` = 2) read the same weight bytes: each step's words are expanded once and multiplied
into each row's own sums (a tuple of sums per row), so the second token costs its products, not the
stream (on one H100 a layer's nine projections took 85.4 µs at two tokens, 75.4 at one, 113.9 at two on a
tensor-core kernel fed from registers). Each row's sums run in the one-row order, so a row gets its one-token
bits (tested); one row compiles to the code it had before there were more.
Not batch invariant (the split depends on the shape): used only outside ``--batch-invariant``, like
``triton_decode_mm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .tile_configs import GEMV_IN_REGISTERS, DecodeConfig, gemv_config
from .triton_common import INTERPRETED, quantize_blocks, sm_count, to_bf16
from .triton_decode_mm import split_count
from .triton_dependent_launch import fetch_into_l2, launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_split_sums import last_to_arrive, reset_counter, split_counters, sum_partials
from .triton_weight_tiles import e4m3_words_to_f32

# rows it takes: each weight value expanded once for all, each row with sums of its own. At three and four
# (256-column steps, so that the sums fit the registers) a tensor-core kernel fed from registers was as fast
# or faster on one H100: the layer's projections 116.2 / 129.4 µs here against 117.0 / 118.5 without PDL
# (with it 105.5 / 121.7 against 121.6 / 123.8; docs/benchmarks-log.md); more tokens take the decode form
MAX_TOKENS = 2


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, w_desc, w2_desc, out_ptr, part_ptr, counter_ptr, N, N2, K,
                     k_per_split, splits, stride_os, stride_x, width, TOKENS: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_K: tl.constexpr, RING: tl.constexpr, QUANTIZE: tl.constexpr, PARTIAL: tl.constexpr,
                     PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_w, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the first weight's row tiles, then the second's (its outputs follow the first's columns)
    tiles = tl.cdiv(N, BLOCK_W)
    if pid_w < tiles:
        weights, scales, tile, first_col, first_row = w_ptr, s_ptr, pid_w, group * N, group * N
    else:
        weights, scales, tile, first_col, first_row = w2_ptr, s2_ptr, pid_w - tiles, N, 0
    x_ptr += group * K
    scales += (first_row + tile * BLOCK_W) // 32 * (K // 32)  # BLOCK_W divides 32: one row of scales
    rows = tile * BLOCK_W + tl.arange(0, BLOCK_W)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if RING == 0:
        sums = _sums_from_registers(weights + first_row * K, scales, x_ptr, stride_x, rows, K, k_begin, k_end, TOKENS,
                                    BLOCK_W, BLOCK_K, QUANTIZE, PDL, INTERPRETED)
    else:
        # with PDL: the ring's first steps are fetched into L2 while the previous kernel finishes, and the
        # next kernel starts only once this one's weight is streamed (its programs, which fetch and
        # wait, then take no room from this one's while they stream)
        _fetch_first_steps(weights + (first_row + tile * BLOCK_W) * K, K, k_begin, k_end, BLOCK_W, BLOCK_K,
                           RING - 1, PDL)
        wait_for_previous_kernel(PDL)
        # (a descriptor cannot be chosen at run time: each weight has its loop)
        if pid_w < tiles:
            sums = _sums_from_ring(w_desc, first_row + tile * BLOCK_W, scales, x_ptr, stride_x, k_begin, k_end,
                                   TOKENS, BLOCK_W, BLOCK_K, RING, QUANTIZE, INTERPRETED)
        else:
            sums = _sums_from_ring(w2_desc, first_row + tile * BLOCK_W, scales, x_ptr, stride_x, k_begin, k_end,
                                   TOKENS, BLOCK_W, BLOCK_K, RING, QUANTIZE, INTERPRETED)
        let_next_kernel_start(PDL)
    columns = first_col + rows  # every row exists: N and N2 are whole 32-row blocks
    for t in tl.static_range(TOKENS):  # token t's outputs (and partials) t output rows further
        acc = tl.sum(tl.sum(sums[t], axis=2), axis=1)
        if PARTIAL:
            tl.store(part_ptr + split * stride_os + t * width + columns, acc)
        else:
            tl.store(out_ptr + t * width + columns, to_bf16(acc, INTERPRETED))
    if PARTIAL:
        counter_ptr += group * tiles + pid_w
        if last_to_arrive(counter_ptr, splits):
            every_column = columns >= 0  # (no mask needed: every row exists)
            for t in tl.static_range(TOKENS):
                total = sum_partials(part_ptr + t * width + columns, splits, stride_os, every_column)
                tl.store(out_ptr + t * width + columns, to_bf16(total, INTERPRETED))
            reset_counter(counter_ptr)


@triton.jit
def _sums_from_registers(weights, scales, x_ptr, stride_x, rows, K, k_begin, k_end, TOKENS: tl.constexpr,
                         BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, QUANTIZE: tl.constexpr, PDL: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """Each token's sums per word position of rows ``rows`` over columns ``k_begin..k_end`` (a tuple of
    ``TOKENS``), the weight loaded straight into registers one step ahead of its use (the last step
    reloads its own), so a step's latency overlaps the previous step's arithmetic (two steps ahead
    measured slower on one H200). The first step's weight needs nothing from earlier kernels: it is
    loaded before the wait."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    blocks = tl.arange(0, BLOCKS)
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCKS, 32]: a step's columns by scale block
    words = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCKS, 8]: a step's weight words (4 bytes each)
    w_ptrs = weights.to(tl.pointer_type(tl.int32), bitcast=True) + rows[:, None, None] * (K // 4) + words[None, :, :]
    sums = _zero_sums(TOKENS, BLOCK_W, BLOCKS)
    raw_next = tl.load(w_ptrs + k_begin // 4)
    w_exp_next = tl.load(scales + k_begin // 32 + blocks)
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    x_next = _token_rows(x_ptr + k_begin, stride_x, cols, TOKENS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        raw, w_exp, x = raw_next, w_exp_next, x_next
        following = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
        raw_next = tl.load(w_ptrs + following // 4)
        w_exp_next = tl.load(scales + following // 32 + blocks)
        x_next = _token_rows(x_ptr + following, stride_x, cols, TOKENS)
        sums = _add_step(sums, e4m3_words_to_f32(raw, INTERPRETED), w_exp, x, BLOCKS, QUANTIZE)
    return sums


@triton.jit
def _fetch_first_steps(tile_start, K, k_begin, k_end, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                       FETCH_STEPS: tl.constexpr, PDL: tl.constexpr):
    """With PDL, the weight of the first ``FETCH_STEPS`` steps (the caller: the ``RING - 1`` that the
    ring's first copies read; rows from ``tile_start``, a byte pointer), fetched into L2 before the
    kernel's wait: one address per 128-byte line, nothing waits for them. (The weights are never written
    during a step.)"""
    if PDL:
        LINES: tl.constexpr = (BLOCK_K + 127) // 128  # a row's lines in one step
        rows = tl.arange(0, BLOCK_W)
        for step in tl.static_range(FETCH_STEPS):
            first = tl.minimum(k_begin + step * BLOCK_K, k_end - BLOCK_K)
            lines = first + tl.arange(0, LINES) * (BLOCK_K // LINES)
            fetch_into_l2(tile_start + rows[:, None] * K + lines[None, :], PDL)


@triton.jit
def _sums_from_ring(desc, first_row, scales, x_ptr, stride_x, k_begin, k_end, TOKENS: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, RING: tl.constexpr, QUANTIZE: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """``_sums_from_registers``' sums, the weight streamed by the tensor memory accelerator through a
    ring of ``RING`` tiles in shared memory (the compiler's pipelining of the descriptor's loads): up to
    ``RING - 1`` steps are in flight while one is used, with no register held for them. The activation
    and the scales (a few hundred bytes a step, from L2) stay one step ahead in registers."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    blocks = tl.arange(0, BLOCKS)
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    sums = _zero_sums(TOKENS, BLOCK_W, BLOCKS)
    w_exp_next = tl.load(scales + k_begin // 32 + blocks)
    x_next = _token_rows(x_ptr + k_begin, stride_x, cols, TOKENS)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=RING):
        raw = tl.reshape(desc.load([first_row, k0 // 4]), (BLOCK_W, BLOCKS, 8))
        w_exp, x = w_exp_next, x_next
        following = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
        w_exp_next = tl.load(scales + following // 32 + blocks)
        x_next = _token_rows(x_ptr + following, stride_x, cols, TOKENS)
        sums = _add_step(sums, e4m3_words_to_f32(raw, INTERPRETED), w_exp, x, BLOCKS, QUANTIZE)
    return sums


@triton.jit
def _zero_sums(TOKENS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCKS: tl.constexpr):
    """One token's sums ``[BLOCK_W, BLOCKS, 8]`` (one per word position) per token: a tuple of ``TOKENS``."""
    sums = ()
    for _ in tl.static_range(TOKENS):
        sums = sums + (tl.zeros((BLOCK_W, BLOCKS, 8), dtype=tl.float32),)
    return sums


@triton.jit
def _token_rows(row_ptr, stride_x, offsets, TOKENS: tl.constexpr):
    """Each token's activation at ``offsets`` from ``row_ptr`` in its row: a tuple of ``TOKENS``."""
    rows = ()
    for _ in tl.static_range(TOKENS):
        rows = rows + (tl.load(row_ptr + offsets),)
        row_ptr += stride_x
    return rows


@triton.jit
def _add_step(sums, values, w_exp, x, BLOCKS: tl.constexpr, QUANTIZE: tl.constexpr):
    """One step's products added to each token's sums (``sums`` and ``x``: tuples of one per token); the
    step's weight words are expanded once (``values``) for all of them."""
    added = ()
    for t in tl.static_range(len(sums)):
        added = added + (_add_products(sums[t], values, w_exp, x[t], BLOCKS, QUANTIZE),)
    return added


@triton.jit
def _add_products(acc, values, w_exp, x, BLOCKS: tl.constexpr, QUANTIZE: tl.constexpr):
    """``acc [rows, BLOCKS, 8]`` plus one step's products of one token: ``values`` the step's weight words
    ``[rows, BLOCKS, 8]`` expanded to their four e4m3 values (``e4m3_words_to_f32``: once for every
    token), ``w_exp [BLOCKS]`` their UE8M0 scale bytes, ``x [BLOCKS, 32]`` the token's activation."""
    scale = (w_exp.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
    a = x.to(tl.float32)
    if QUANTIZE:
        a, a_scale = quantize_blocks(a)
        scale = a_scale * scale
    # the block's scales go onto the activation (a power of two: exact), so every product is
    # exact and the sum runs over the whole K without a reduction per block
    a = tl.reshape(a * scale[:, None], (BLOCKS, 8, 2, 2))  # [block, word, byte // 2, byte % 2]
    a_even, a_odd = tl.split(a)
    a0, a2 = tl.split(a_even)
    a1, a3 = tl.split(a_odd)
    w0, w1, w2, w3 = values
    acc += w0 * a0[None, :, :]
    acc += w1 * a1[None, :, :]
    acc += w2 * a2[None, :, :]
    acc += w3 * a3[None, :, :]
    return acc


def fits(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``fp8_gemv`` takes this weight: contiguous, of whole 32x32 scale blocks."""
    return values.shape[0] % 32 == 0 and values.shape[-1] % 32 == 0 and values.is_contiguous() \
        and scales.is_contiguous()


def fp8_gemv(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]], quantize: bool,
             groups: int = 1, pdl: bool = False) -> torch.Tensor:
    """``x [M, G*K]`` bf16 (M <= ``MAX_TOKENS``) times one or two FP8 weights ``(values [G*N, K], scales
    [G*N/32, K/32])`` -> ``[M, G*N (+ N2)]`` bf16, the second weight's outputs after the first's (two weights: G = 1);
    ``quantize``: the activation's FP8 round trip first; ``pdl``: programmatic dependent launch where
    the GPU has it (``triton_dependent_launch``)."""
    m = x.shape[0]
    k = x.shape[1] // groups
    (values, scales), second = weights[0], weights[1:]
    n = values.shape[0] // groups
    n2 = second[0][0].shape[0] if second else 0
    if not 1 <= m <= MAX_TOKENS or len(weights) > 2 or (second and groups > 1):
        raise ValueError(f"fp8_gemv takes 1-{MAX_TOKENS} rows and one or two weights (one group for two), got {m} "
                         f"rows, {len(weights)} weights, {groups} groups")
    for v, sc in weights:
        if v.shape[1] != k or not fits(v, sc):
            raise ValueError(f"fp8_gemv takes contiguous weights of whole 32x32 scale blocks and K = {k}, "
                             f"got {list(v.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = gemv_config(m, groups * n + n2, k)
    if cfg.num_stages > 1 and not all(_ring_fits(v) for v, _ in weights):
        cfg = GEMV_IN_REGISTERS
    while k % cfg.block_k:  # whole steps (the shared expert's w2, K = 2304, takes 256 columns)
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    splits, k_per_split = split_count(cfg, n + n2, k, groups, sm_count(x.device))
    width = groups * n + n2
    out = torch.empty(m, width, dtype=torch.bfloat16, device=x.device)
    partials = torch.empty(splits, m, width, dtype=torch.float32, device=x.device) if splits > 1 else out
    w, s = values.view(torch.uint8), scales.view(torch.uint8)
    w2, s2 = (second[0][0].view(torch.uint8), second[0][1].view(torch.uint8)) if second else (w, s)
    ring = cfg.num_stages if cfg.num_stages > 1 else 0
    # (the registers' loop reads no descriptor: the weights stand in for them)
    w_desc, w2_desc = (_descriptor(w, cfg), _descriptor(w2, cfg)) if ring else (w, w2)
    tiles = triton.cdiv(n, cfg.block_w) + triton.cdiv(n2, cfg.block_w)
    _fp8_gemv_kernel[(tiles, splits, groups)](
        x, w, s, w2, s2, w_desc, w2_desc, out, partials, split_counters(x.device, tiles * groups), n, n2, k,
        k_per_split, splits, m * width, x.stride(0), width, TOKENS=m, BLOCK_W=cfg.block_w, BLOCK_K=cfg.block_k,
        RING=ring, QUANTIZE=quantize, PARTIAL=splits > 1, INTERPRETED=INTERPRETED, num_warps=cfg.num_warps,
        **launch_arguments(pdl, x.device))
    return out


def _ring_fits(values: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can stream this weight: a 16-byte aligned start (rows of
    whole 32-byte multiples are aligned after it)."""
    return values.data_ptr() % 16 == 0


def _descriptor(values: torch.Tensor, cfg: DecodeConfig) -> TensorDescriptor:
    """The weight's bytes as int32 words ``[rows, K / 4]``, read ``block_w`` rows x ``block_k`` columns
    at a time (as the registers' loop reads them)."""
    words = values.view(torch.int32)
    return TensorDescriptor.from_tensor(words, [cfg.block_w, cfg.block_k // 4])

