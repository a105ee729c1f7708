"""A few tokens' products with FP8 weights on the tensor cores, fed straight from registers.

``fp8_mma_gemv(x, [(values, scales), ...], quantize, groups)``: ``triton_gemv.fp8_gemv``'s contract
for 1 to 8 rows: ``x [M, G*K]`` bf16 times one or two FP8 weights ``values [G*N, K]`` (e4m3 bytes)
with their ``scales [G*N/32, K/32]`` (UE8M0 per 32x32 tile) -> bf16 ``[M, G*N (+ N2)]``.

Why: ``triton_gemv`` expands every weight byte to fp32 and multiplies on the CUDA cores, ~5
instructions per weight byte and thread. An H200 must take ~16 weight bytes per SM and cycle from
HBM to run at its bandwidth, so that loop is bound by instruction issue (docs/benchmarks.md). One
``mma.sync.m16n8k16`` takes a 16 x 16 tile of weight, 8 bytes from each of a warp's 32 lanes, as f16
operands: per 8 weight bytes (one load) a lane spends four conversions (a pair of e4m3 bytes to a
pair of f16 is one instruction) and one tensor-core instruction, ~1.5 instructions per weight byte
in the loop against ~4.9 (both compiled for sm_90; docs/benchmarks.md). The product's 8 token
columns hold up to 8 tokens; at one token the other 7 multiply zeros, which costs nothing extra.

Fragments without a shuffle. A warp owns 32 weight rows (one row of 32x32 scale tiles, so one weight
scale per block) and walks its K range one 32-column scale block at a time (one, two or four per
loop step: ``block_k`` of the config; longer steps keep more loads in flight and ask for 128
contiguous bytes of each row at once, for more registers). Lane
``l`` (``g = l // 4``, ``t = l % 4``) loads 8 bytes of each of its rows g, g+8, g+16 and g+24 at
columns 8t..8t+7 of the block. The m16n8k16 A fragment gives lane (g, t) rows g and g+8 at K slots
2t, 2t+1, 2t+8 and 2t+9, and its B fragment token g at the same four slots. A product does not care
which column a K slot stands for as long as A and B agree, so lane t's slots stand for its own
columns 8t..8t+3 in the block's first product and 8t+4..8t+7 in its second: the low two bytes of
each loaded word become slots 2t, 2t+1 by one conversion, the high two slots 2t+8, 2t+9, and B is
token g's activation at the same columns, loaded as it lies in memory.

The activation: each program first issues the loads of its first step of weight (they wait for
nothing), then writes its K range of the activation to a scratch area of its own, as f16 values and
an fp32 scale per token and 32-column block (the scales of at least two tokens, so that every lane's
pair of token scales exists), ``PREP_BLOCKS`` blocks per loop step. With
``quantize`` that is the reference's FP8 round trip per 32 (``act_quant``: e4m3 values are exact in
f16, the scale is their power of two); without, the bf16 values times the power of two that puts the
block's largest just below 2**16 (exact for every value down to 2**-32 of the block's largest; a
smaller one is rounded, by less than 2**-39 of the largest). After a barrier the lanes load their B
fragments from it.

Arithmetic: every product is exact (an e4m3 weight times an e4m3 or 8-bit-significand activation,
as f16 operands). The tensor cores sum a block's 32 products per row and token in fp32, the block's
two scales (powers of two) multiply that sum, and one fp32 add takes it into the row's total: the
reference's order (each block summed, scaled, then the blocks added in order) but for the order of
the sums inside a block. The result stays within one bf16 ulp of the reference's (tested).

Lanes: each thread's lane and warp are read from the hardware into tensors of one element per thread
and every fragment is loaded, multiplied and stored element by element (``triton_warp_fragments``). In
Triton's interpreter (no inline assembly) the tensor-core instruction is computed by tensor operations
over the same fragments.

K is split as in ``triton_gemv`` so that enough programs stream the weight, and the last split of a
tile adds the fp32 partials in split order (``triton_split_sums``). Not batch invariant (the split
depends on the shape): used outside ``--batch-invariant`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import tile_configs
from .tile_configs import mma_gemv_config
from .triton_common import INTERPRETED, quantize_blocks, sm_count, to_bf16
from .triton_decode_mm import split_count
from .triton_dependent_launch import (compute_capability, launch_arguments, let_next_kernel_start,
                                      wait_for_previous_kernel)
from .triton_gemv import fits
from .triton_split_sums import last_to_arrive, reset_counter, split_counters, sum_partials
from .triton_warp_fragments import warp_lanes

MAX_TOKENS = 8  # the token columns of one tensor-core product
ROWS_PER_WARP = 32  # one row of the weight's 32x32 scale tiles
BLOCK = 32  # K columns of one scale block (a loop step takes one, two or four)
STEP_BLOCKS = (1, 2, 4)
# The activation's preparation walks the program's K range in loop steps of this many 32-column blocks. Each
# step waits for its loads and nothing else runs meanwhile (only the ring's first steps of weight are in
# flight), so the steps are few and long. Steps of 4 blocks took up to 10 round trips at the tables' splits; 16
# took a layer's projections 103.7 -> 97.2 µs at 3 tokens and 114.5 -> 111.1 at 8 on one H100, 8 blocks 98.8 /
# 110.8; the engine's decode did not move, and not because its inputs lie in L2: the layer's graph with each
# input written just before its projection took the same time (docs/benchmarks.md). 32 blocks of 8 tokens spill
# registers
PREP_BLOCKS = 16


# One 32-column block of a 16-row group: $4, $5 the 8 weight bytes of rows g and g+8 at columns
# 8t..8t+7; $6, $7 token g's activation at columns 8t..8t+3 and 8t+4..8t+7 (four f16 each); $8, $9 the
# block's scales of tokens 2t and 2t+1 (activation times weight); $10..$13 the running sums of (row g,
# token 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1), which $0..$3 return. (Hopper's ``mma.sync`` has no
# e4m3 operands of its own: ptxas turns an m16n8k32 e4m3 product into these same conversions, plus
# those of the activation.)
_GROUP_STEP_PTX = tl.constexpr("""{
    .reg .b32 w<4>, x<4>, a<8>;
    .reg .b16 h<8>;
    .reg .f32 d<4>, zero;
    mov.b64 {w0, w1}, $4;
    mov.b64 {w2, w3}, $5;
    mov.b64 {x0, x1}, $6;
    mov.b64 {x2, x3}, $7;
    mov.b32 {h0, h1}, w0;
    mov.b32 {h2, h3}, w2;
    mov.b32 {h4, h5}, w1;
    mov.b32 {h6, h7}, w3;
    cvt.rn.f16x2.e4m3x2 a0, h0;
    cvt.rn.f16x2.e4m3x2 a1, h2;
    cvt.rn.f16x2.e4m3x2 a2, h1;
    cvt.rn.f16x2.e4m3x2 a3, h3;
    cvt.rn.f16x2.e4m3x2 a4, h4;
    cvt.rn.f16x2.e4m3x2 a5, h6;
    cvt.rn.f16x2.e4m3x2 a6, h5;
    cvt.rn.f16x2.e4m3x2 a7, h7;
    mov.f32 zero, 0f00000000;
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a0, a1, a2, a3}, {x0, x1}, {zero, zero, zero, zero};
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a4, a5, a6, a7}, {x2, x3}, {d0, d1, d2, d3};
    fma.rn.f32 $0, d0, $8, $10;
    fma.rn.f32 $1, d1, $9, $11;
    fma.rn.f32 $2, d2, $8, $12;
    fma.rn.f32 $3, d3, $9, $13;
}""")


@triton.jit
def _group_step(s0, s1, s2, s3, w_g, w_g8, x_lo, x_hi, scale_even, scale_odd, INTERPRETED: tl.constexpr):
    """``_GROUP_STEP_PTX``: one block of one 16-row group added to its four running sums."""
    if INTERPRETED:
        # the tensor-core product over the same fragments: lane (g, t)'s 8 weight columns of rows g and
        # g + 8 against token n's activation at the same columns, summed over the 4 lanes t
        threads: tl.constexpr = w_g.shape[0]
        d_even, d_odd = tl.split(tl.reshape(_emulated_product(w_g, x_lo, x_hi, threads), (threads, 2)))
        d8_even, d8_odd = tl.split(tl.reshape(_emulated_product(w_g8, x_lo, x_hi, threads), (threads, 2)))
        return s0 + d_even * scale_even, s1 + d_odd * scale_odd, s2 + d8_even * scale_even, s3 + d8_odd * scale_odd
    else:
        return tl.inline_asm_elementwise(
            asm=_GROUP_STEP_PTX, constraints="=f,=f,=f,=f,l,l,l,l,f,f,f,f,f,f",
            args=[w_g, w_g8, x_lo, x_hi, scale_even, scale_odd, s0, s1, s2, s3], dtype=(tl.float32,) * 4,
            is_pure=False, pack=1)


@triton.jit
def _emulated_product(w, x_lo, x_hi, THREADS: tl.constexpr):
    """The two m16n8k16 products of one block for the rows whose 8 bytes per lane ``w`` holds, the
    tensor cores' result computed by tensor operations (interpreter only): ``[THREADS * 2]``, lane
    (g, t)'s row g times tokens 2t and 2t + 1 at ``2 * lane`` and ``2 * lane + 1``."""
    WARPS: tl.constexpr = THREADS // 32
    byte = tl.arange(0, 8)
    weight = ((w[:, None] >> (byte * 8)[None, :]) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    half = tl.arange(0, 4)
    low = ((x_lo[:, None] >> (half * 16)[None, :]) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    high = ((x_hi[:, None] >> (half * 16)[None, :]) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    weight = tl.reshape(weight.to(tl.float32), (WARPS, 8, 4, 2, 4))  # [warp, g, t, product, column]
    act = tl.reshape(tl.join(low.to(tl.float32), high.to(tl.float32)), (WARPS, 8, 4, 4, 2))
    act = tl.permute(act, (0, 1, 2, 4, 3))  # [warp, token, t, product, column]
    # sum over the lanes t (the K slots) and both products: [warp, row g, token]
    d = tl.sum(tl.sum(tl.sum(weight[:, :, None] * act[:, None], axis=5), axis=4), axis=3)
    return tl.reshape(d, (THREADS * 2,))


@triton.jit
def _block_weights(pointers, b, K: tl.constexpr):
    """Block ``b`` (counted from the pointers ``(w_words, w_exps)``) of a lane's weight: the 8 bytes of
    each of its rows g, g + 8, g + 16, g + 24 (K words apart) and the block's scale exponent."""
    w_words, w_exps = pointers
    w = w_words + b * 4
    return tl.load(w), tl.load(w + K), tl.load(w + 2 * K), tl.load(w + 3 * K), tl.load(w_exps + b).to(tl.int32)


@triton.jit
def _block_activation(pointers, b, TOKENS: tl.constexpr):
    """Block ``b`` (counted from the pointers ``(x_words, scale_words)``) of a lane's activation: token
    g's values at its 8 columns (two words of four f16) and the scales of tokens 2t and 2t + 1."""
    x_words, scale_words = pointers
    x = x_words + b * (TOKENS * 8)
    return tl.load(x), tl.load(x + 1), tl.load(scale_words + b * (TOKENS // 2))


@triton.jit
def _add_block(sums, weights, activation, INTERPRETED: tl.constexpr):
    """A block's products added to a lane's eight sums (rows g, g + 8, g + 16, g + 24 x tokens 2t, 2t + 1)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = sums
    w0, w1, w2, w3, w_exp = weights
    x_lo, x_hi, a_scales = activation
    w_scale = (w_exp << 23).to(tl.float32, bitcast=True)
    scale_even = (a_scales & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True) * w_scale
    scale_odd = (a_scales >> 32).to(tl.int32).to(tl.float32, bitcast=True) * w_scale
    a0, a1, a2, a3 = _group_step(a0, a1, a2, a3, w0, w1, x_lo, x_hi, scale_even, scale_odd, INTERPRETED)
    b0, b1, b2, b3 = _group_step(b0, b1, b2, b3, w2, w3, x_lo, x_hi, scale_even, scale_odd, INTERPRETED)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _load_step(load_block: tl.constexpr, pointers, b, SIZE: tl.constexpr, STEP_BLOCKS: tl.constexpr):
    """The blocks of the loop step that starts at block ``b``, each loaded by ``load_block``
    (``_block_weights`` or ``_block_activation``; ``SIZE`` its K or TOKENS): 1, 2 or 4 of them (unused
    places repeat the last block; nothing is loaded twice)."""
    first = load_block(pointers, b, SIZE)
    if STEP_BLOCKS == 1:
        return first, first, first, first
    elif STEP_BLOCKS == 2:
        second = load_block(pointers, b + 1, SIZE)
        return first, second, second, second
    else:
        return (first, load_block(pointers, b + 1, SIZE), load_block(pointers, b + 2, SIZE),
                load_block(pointers, b + 3, SIZE))


@triton.jit
def _add_step(sums, weights, activation, STEP_BLOCKS: tl.constexpr, INTERPRETED: tl.constexpr):
    """A loop step's blocks added to a lane's eight sums, in K order."""
    w0, w1, w2, w3 = weights
    x0, x1, x2, x3 = activation
    sums = _add_block(sums, w0, x0, INTERPRETED)
    if STEP_BLOCKS >= 2:
        sums = _add_block(sums, w1, x1, INTERPRETED)
    if STEP_BLOCKS == 4:
        sums = _add_block(sums, w2, x2, INTERPRETED)
        sums = _add_block(sums, w3, x3, INTERPRETED)
    return sums


@triton.jit
def _f16_blocks(g):
    """bf16 values as fp32 ``[..., 32]`` -> (f16-ready values ``[..., 32]``, scales ``[...]``): each
    block times the power of two that puts its largest magnitude in [2**15, 2**16)."""
    amax = tl.max(tl.abs(g), axis=-1)
    biased = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)  # floor: scales stay normal
    scale = ((biased - 15) << 23).to(tl.float32, bitcast=True)  # 2**(e - 15)
    inverse = ((269 - biased) << 23).to(tl.float32, bitcast=True)  # 2**(15 - e), exact
    return g * tl.expand_dims(inverse, -1), scale


@triton.jit
def _fp8_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counter_ptr, act_ptr,
                         act_scale_ptr, M, N, N2, stride_x, k_per_split, splits, width,
                         K: tl.constexpr, TOKENS: tl.constexpr, WARPS: tl.constexpr, STEP_BLOCKS: tl.constexpr,
                         PREP_BLOCKS: tl.constexpr, QUANTIZE: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    pid_w, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    TILE: tl.constexpr = 32 * WARPS  # weight rows per program
    # the first weight's row tiles, then the second's (its outputs follow the first's columns)
    tiles = tl.cdiv(N, TILE)
    if pid_w < tiles:
        weights, scales, tile, first_col, n = w_ptr, s_ptr, pid_w, group * N, N
    else:
        weights, scales, tile, first_col, n = w2_ptr, s2_ptr, pid_w - tiles, N, N2
    x_ptr += group * K
    weights += group * N * K
    scales += group * (N // 32) * (K // 32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    blocks = (k_end - k_begin) // 32
    program = (group * tl.num_programs(0) + pid_w) * splits + split
    act_ptr += program * (k_per_split // 32) * TOKENS * 32
    act_scale_ptr += program * (k_per_split // 32) * TOKENS

    # 1. each lane's fragments, one element per thread (the module's docstring). Nothing is masked: a
    # warp past the last row reads the last row, a lane whose token g is past the last reads the last,
    # a lane whose tokens 2t, 2t + 1 are past the tile's reads the tile's last two (none of those sums
    # is stored). The first loop step's weight is loaded now: it does not wait for the activation
    lane, warp = warp_lanes(32 * WARPS, INTERPRETED)
    g = lane // 4
    t = lane % 4
    warp_row = tile * TILE + warp * 32  # the warp's 32 rows: one row of scale tiles
    live = warp_row < n  # N is whole 32-row blocks: a warp's rows all exist or none does
    first_row = tl.minimum(warp_row, n - 32)
    w_words = weights.to(tl.pointer_type(tl.int64), bitcast=True) + (first_row + g).to(tl.int64) * (K // 8) \
        + t + k_begin // 8  # row g at columns 8t.. of the first block; rows g + 8, 16, 24 are K words on
    w_exps = scales + first_row // 32 * (K // 32) + k_begin // 32 + tl.zeros_like(lane)
    w_even = _load_step(_block_weights, (w_words, w_exps), 0, K, STEP_BLOCKS)
    wait_for_previous_kernel(PDL)  # the activation and the scratch below may be an earlier kernel's
    let_next_kernel_start(PDL)

    # 2. this program's K range of the activation, as f16 values and fp32 scales per token and block
    tokens = tl.arange(0, TOKENS)
    prep_blocks = tl.arange(0, PREP_BLOCKS)
    columns = tl.arange(0, 32)
    for b0 in range(0, blocks, PREP_BLOCKS):
        block = b0 + prep_blocks  # [PREP_BLOCKS], local to the split
        cols = k_begin + block[:, None] * 32 + columns[None, :]
        valid = (tokens < M)[:, None, None] & (block < blocks)[None, :, None]
        x = tl.load(x_ptr + tokens[:, None, None] * stride_x + cols[None], mask=valid, other=0.0).to(tl.float32)
        if QUANTIZE:
            values, act_scale = quantize_blocks(x)  # [TOKENS, PREP_BLOCKS, 32], [TOKENS, PREP_BLOCKS]
        else:
            values, act_scale = _f16_blocks(x)
        tl.store(act_ptr + (block[None, :, None] * TOKENS + tokens[:, None, None]) * 32 + columns[None, None, :],
                 values.to(tl.float16), mask=valid)
        tl.store(act_scale_ptr + block[None, :] * TOKENS + tokens[:, None], act_scale,  # absent tokens' too
                 mask=(block < blocks)[None, :])
    tl.debug_barrier()  # every thread's part of the scratch written before any lane loads from it
    x_words = act_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + tl.minimum(g, M - 1) * 8 + 2 * t
    scale_words = act_scale_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + tl.minimum(t, TOKENS // 2 - 1)
    x_even = _load_step(_block_activation, (x_words, scale_words), 0, TOKENS, STEP_BLOCKS)

    # 3. running sums of rows g, g + 8 (a) and g + 16, g + 24 (b) x tokens 2t, 2t + 1, STEP_BLOCKS blocks
    # per loop step. Every step's loads are issued before the previous step's products, into two sets
    # of registers taken in turn (two steps per loop iteration), so that no loaded value is copied
    zero = tl.zeros((32 * WARPS,), dtype=tl.float32)
    sums = (zero, zero, zero, zero, zero, zero, zero, zero)
    steps = blocks // STEP_BLOCKS
    for _ in range(0, (steps - 1) // 2):
        w_odd = _load_step(_block_weights, (w_words, w_exps), STEP_BLOCKS, K, STEP_BLOCKS)
        x_odd = _load_step(_block_activation, (x_words, scale_words), STEP_BLOCKS, TOKENS,
                           STEP_BLOCKS)
        sums = _add_step(sums, w_even, x_even, STEP_BLOCKS, INTERPRETED)
        w_words += 8 * STEP_BLOCKS  # two steps
        w_exps += 2 * STEP_BLOCKS
        x_words += TOKENS * 16 * STEP_BLOCKS
        scale_words += TOKENS * STEP_BLOCKS
        w_even = _load_step(_block_weights, (w_words, w_exps), 0, K, STEP_BLOCKS)
        x_even = _load_step(_block_activation, (x_words, scale_words), 0, TOKENS, STEP_BLOCKS)
        sums = _add_step(sums, w_odd, x_odd, STEP_BLOCKS, INTERPRETED)
    if steps % 2 == 0:  # one step after the last even one
        w_odd = _load_step(_block_weights, (w_words, w_exps), STEP_BLOCKS, K, STEP_BLOCKS)
        x_odd = _load_step(_block_activation, (x_words, scale_words), STEP_BLOCKS, TOKENS,
                           STEP_BLOCKS)
        sums = _add_step(sums, w_even, x_even, STEP_BLOCKS, INTERPRETED)
        sums = _add_step(sums, w_odd, x_odd, STEP_BLOCKS, INTERPRETED)
    else:
        sums = _add_step(sums, w_even, x_even, STEP_BLOCKS, INTERPRETED)

    # 4. each lane's eight sums to their places: [splits, M, width] fp32 partials or the bf16 output
    destination = part_ptr + split * M * width if PARTIAL else out_ptr
    store_lane_sums(destination, sums, t, first_col + warp_row + g, width, M, live, PARTIAL, INTERPRETED)
    if PARTIAL:
        counter_ptr += group * tl.num_programs(0) + pid_w
        if last_to_arrive(counter_ptr, splits):
            tile_rows = tile * TILE + tl.arange(0, TILE)
            places = tokens[:, None] * width + (first_col + tile_rows)[None, :]
            mask = (tokens < M)[:, None] & (tile_rows < n)[None, :]
            total = sum_partials(part_ptr + places, splits, M * width, mask)
            tl.store(out_ptr + places, to_bf16(total, INTERPRETED), mask=mask)
            reset_counter(counter_ptr)


@triton.jit
def store_lane_sums(destination, sums, t, column, width, M, live, PARTIAL: tl.constexpr, INTERPRETED: tl.constexpr):
    """A lane's eight sums (rows ``column``, ``+ 8``, ``+ 16``, ``+ 24`` x tokens ``2t``, ``2t + 1``) to
    ``destination`` (``[M, width]``, fp32 partials or the bf16 output)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = sums
    _store_sums(destination, a0, a1, a2, a3, 2 * t, column, width, M, live, PARTIAL, INTERPRETED)
    _store_sums(destination, b0, b1, b2, b3, 2 * t, column + 16, width, M, live, PARTIAL, INTERPRETED)


@triton.jit
def _store_sums(ptr, s0, s1, s2, s3, token, column, width, M, live, PARTIAL: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """A 16-row group's sums: rows ``column`` and ``column + 8`` x tokens ``token`` and ``token + 1``."""
    _store(ptr + token * width + column, s0, live & (token < M), PARTIAL, INTERPRETED)
    _store(ptr + (token + 1) * width + column, s1, live & (token + 1 < M), PARTIAL, INTERPRETED)
    _store(ptr + token * width + column + 8, s2, live & (token < M), PARTIAL, INTERPRETED)
    _store(ptr + (token + 1) * width + column + 8, s3, live & (token + 1 < M), PARTIAL, INTERPRETED)


@triton.jit
def _store(ptr, value, mask, PARTIAL: tl.constexpr, INTERPRETED: tl.constexpr):
    if PARTIAL:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, to_bf16(value, INTERPRETED), mask=mask)


def fp8_mma_gemv(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]], quantize: bool,
                 groups: int = 1, pdl: bool = False) -> torch.Tensor:
    """``x [M, G*K]`` bf16 (1 <= M <= 8) times one or two FP8 weights ``(values [G*N, K], scales
    [G*N/32, K/32])`` -> ``[M, G*N (+ N2)]`` bf16, the second weight's outputs after the first's (two
    weights: G = 1); ``quantize``: the activation's FP8 round trip per 32 first; ``pdl``: programmatic
    dependent launch where the GPU has it (``triton_dependent_launch``). A config with a ring
    (``num_stages`` > 1) streams the weight through shared memory (``triton_ring_mma_gemv``: the same
    bits) where the GPU and the weight allow it (``ring_takes``) and ``tile_configs.MMA_GEMV_RING`` is on."""
    m = x.shape[0]
    k = x.shape[1] // groups
    (values, scales), second = weights[0], weights[1:]
    n = values.shape[0] // groups
    n2 = second[0][0].shape[0] if second else 0
    if not 1 <= m <= MAX_TOKENS or len(weights) > 2 or (second and groups > 1):
        raise ValueError(f"fp8_mma_gemv takes 1 to {MAX_TOKENS} rows and one or two weights (one group for two), "
                         f"got {m} rows, {len(weights)} weights, {groups} groups")
    for v, sc in weights:
        if v.shape[1] != k or not fits(v, sc) or v.data_ptr() % 8:
            raise ValueError(f"fp8_mma_gemv takes contiguous, 8-byte aligned weights of whole 32x32 scale blocks "
                             f"and K = {k}, got {list(v.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = mma_gemv_config(m, groups * n + n2, k)
    if cfg.block_w != ROWS_PER_WARP * cfg.num_warps or cfg.block_k not in [BLOCK * s for s in STEP_BLOCKS]:
        raise ValueError(f"a triton_mma_gemv config has {ROWS_PER_WARP} rows per warp and steps of "
                         f"{' / '.join(map(str, STEP_BLOCKS))} {BLOCK}-column blocks, got {cfg}")
    if k % cfg.block_k:  # whole steps in every split: the longest step that divides K
        cfg = dataclasses.replace(cfg, block_k=max(BLOCK * s for s in STEP_BLOCKS if k % (BLOCK * s) == 0))
    splits, k_per_split = split_count(cfg, n + n2, k, groups, sm_count(x.device))
    tiles = triton.cdiv(n, cfg.block_w) + triton.cdiv(n2, cfg.block_w)
    width = groups * n + n2
    out = torch.empty(m, width, dtype=torch.bfloat16, device=x.device)
    partials = torch.empty(splits, m, width, dtype=torch.float32, device=x.device) if splits > 1 else out
    tokens = max(2, triton.next_power_of_2(m))  # the activation tile's rows: whole pairs of token scales
    programs = tiles * splits * groups
    act = torch.empty(programs, k_per_split // BLOCK, tokens, BLOCK, dtype=torch.float16, device=x.device)
    act_scales = torch.empty(programs, k_per_split // BLOCK, tokens, dtype=torch.float32, device=x.device)
    if cfg.num_stages > 1 and tile_configs.MMA_GEMV_RING and all(ring_takes(v) for v, _ in weights):
        # (imported here: the ring's kernel is built from this module's functions)
        from .triton_ring_mma_gemv import launch_ring
        launch_ring((tiles, splits, groups), x, weights, out, partials, act, act_scales, m, n, n2, k_per_split, splits,
                    width, k, tokens, quantize, cfg, pdl)
        return out
    w, s = values.view(torch.uint8), scales.view(torch.uint8)
    w2, s2 = (second[0][0].view(torch.uint8), second[0][1].view(torch.uint8)) if second else (w, s)
    _fp8_mma_gemv_kernel[(tiles, splits, groups)](
        x, w, s, w2, s2, out, partials, split_counters(x.device, tiles * groups), act, act_scales,
        m, n, n2, x.stride(0), k_per_split, splits, width, K=k, TOKENS=tokens, WARPS=cfg.num_warps,
        STEP_BLOCKS=cfg.block_k // BLOCK, PREP_BLOCKS=activation_prep_blocks(k_per_split),
        QUANTIZE=quantize, PARTIAL=splits > 1, INTERPRETED=INTERPRETED, num_warps=cfg.num_warps,
        **launch_arguments(pdl, x.device))
    return out


def activation_prep_blocks(k_per_split: int) -> int:
    """Scale blocks per loop step of the activation's preparation: ``PREP_BLOCKS``, fewer for a shorter split."""
    return min(PREP_BLOCKS, triton.next_power_of_2(k_per_split // BLOCK))


def ring_takes(values: torch.Tensor) -> bool:
    """Whether ``triton_ring_mma_gemv`` can stream this weight: on a GPU with the tensor memory
    accelerator (Hopper on), from a 16-byte aligned start (its rule)."""
    return values.is_cuda and not INTERPRETED and values.data_ptr() % 16 == 0 and \
        compute_capability(values.device.index or 0) >= 9
