"""A few tokens' products with FP8 weights on the tensor cores, the weight streamed through a TMA ring.

``triton_mma_gemv.fp8_mma_gemv`` launches this kernel when its config has a ring (``num_stages`` > 1)
and the GPU and weight allow (``triton_mma_gemv.ring_takes``): the same contract, arithmetic, split and
bits (tested), only the way the weight comes in differs.

Why: ``triton_mma_gemv`` loads each lane's weight bytes from global memory straight into registers, one
loop step ahead. A program keeps only those few KB in flight, and at 3 to 8 tokens the layer's
projections stream at 47-50% of the memory limit on an H100 (docs/benchmarks.md). The one-token kernel
(``triton_gemv``) reaches 71% there once its weight comes through a ring of tiles in shared memory that
the tensor memory accelerator (TMA) fills several steps ahead: no register holds a byte in flight.
Triton's own pipelining cannot feed ``mma.sync`` that way: each lane needs its own fragment of the
tile, and plain Triton picks the layout of a loaded tile itself. This kernel is written in Gluon
(``triton_gluon``), where the layout is ours to say.

The ring: ``STAGES`` slots of one loop step each (``STEP_BLOCKS`` 32-column blocks of the program's
``32 * WARPS`` rows: one TMA box and one mbarrier per slot). The program asks for the first ``STAGES``
steps before anything else (before its wait under programmatic dependent launch: the weight does not
depend on the kernel before). At each step it waits for its slot, every thread reads its fragments out
of it, all threads meet at a barrier, and the slot is asked for again with the step ``STAGES`` further
on, before the step's products: up to ``STAGES`` steps stream while it computes.

Fragments: a slot holds rows of ``32 * STEP_BLOCKS`` bytes, read as 8-byte words. Lane ``(g, t)`` of
warp ``w`` reads word ``t`` of each block of its rows ``32w + g``, ``+ 8``, ``+ 16``, ``+ 24``: the
``triton_mma_gemv`` fragments (its docstring), now one ``ld.shared.b64`` each. A warp reads eight rows
at a time. Rows of 64 or 128 bytes would put those eight on the same banks, so the TMA swizzles each
row's 16-byte chunks (``ring_layouts``) and the lanes read them through the same swizzle: a warp's
256 bytes then take two passes over the 32 banks, the fewest they can. The activation (its preparation
into a scratch area per program, its loads one step ahead), the products (``mma.sync`` through the same
PTX), the scales and the split sums are ``triton_mma_gemv``'s own functions.

Measured (one H100, docs/benchmarks.md): taken where the per-launch sweep found it faster
(``tile_configs._MMA_GEMV_BY_SHAPE``), the layer's projections went 110.6 -> 104.7 µs at 4 tokens and
119.3 -> 114.3 at 8. At one and two tokens it stays well behind ``triton_gemv`` (102.4 / 101.0 against
77.5 / 89.4 µs): what it still spends beyond the bytes is the tensor-core kernel's fixed part (the
activation's scratch, the split sums), not the way the weight arrives. The barrier between reading a
slot and asking for it again costs nothing measurable (removed, as a race, for timing only: the same
layer graph).

Weights whose start is not 16-byte aligned (TMA's rule) keep ``triton_mma_gemv``'s registers. Not
batch invariant (the split depends on the shape), like ``triton_mma_gemv``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .tile_configs import DecodeConfig
from .triton_common import quantize_blocks, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_gluon import TensorDescriptor, cta_barrier, fence_async_shared, gl, gluon, mbarrier, reinterpret, \
    tma_load
from .triton_mma_gemv import (BLOCK, _add_step, _block_activation, _f16_blocks, _load_step, activation_prep_blocks,
                              store_lane_sums)
from .triton_split_sums import last_to_arrive, reset_counter, split_counters, sum_partials


@gluon.jit
def _fetch_step(w_desc, w2_desc, second, ring, ready, step, row, k_begin, STEP_BLOCKS: gl.constexpr,
                STAGES: gl.constexpr, TILE: gl.constexpr):
    """Ask the TMA for loop step ``step``'s box of the program's rows, into its ring slot."""
    slot = step % STAGES
    mbarrier.expect(ready.index(slot), TILE * STEP_BLOCKS * 32)
    where = [row, k_begin + step * STEP_BLOCKS * 32]
    # (a descriptor cannot be chosen at run time: each weight has its copy)
    if second:
        tma_load(w2_desc, where, ready.index(slot), ring.index(slot))
    else:
        tma_load(w_desc, where, ready.index(slot), ring.index(slot))


@triton.jit
def _block_exponent(exps, b, SIZE: tl.constexpr):
    """The scale exponent of block ``b`` of a lane's rows (``_load_step``'s form of a block's loads)."""
    return tl.load(exps + b).to(tl.int32)


@gluon.jit
def _block_from_ring(rows, j, exponent, LANES: gl.constexpr):
    """A lane's weight of block ``j`` of a step from its ring slot (``rows``: the slot as ``[w, r, word]``)
    as ``triton_mma_gemv`` loads it: the 8 bytes of each of its rows g, g + 8, g + 16, g + 24 at its
    columns, and the block's scale exponent."""
    block = rows.slice(4 * j, 4, dim=2)  # the block's 4 words of each row; a quarter q: rows 8q + g
    return (block.slice(0, 8, dim=1).load(LANES), block.slice(8, 8, dim=1).load(LANES),
            block.slice(16, 8, dim=1).load(LANES), block.slice(24, 8, dim=1).load(LANES), exponent)


@gluon.jit
def _step_from_ring(ring, slot, exponents, WARPS: gl.constexpr, LANES: gl.constexpr, STEP_BLOCKS: gl.constexpr,
                    WORDS_LAYOUT: gl.constexpr):
    """The blocks of the loop step in ring slot ``slot``, with their ``exponents`` (loaded a step ahead),
    as ``_load_step`` gives them."""
    # the slot's rows 32w + r as [w, r, word], with the swizzle the TMA wrote them in (``ring_layouts``)
    rows = reinterpret(ring.index(slot), gl.int64, [WARPS, 32, 4 * STEP_BLOCKS], WORDS_LAYOUT)
    e0, e1, e2, e3 = exponents
    first = _block_from_ring(rows, 0, e0, LANES)
    if STEP_BLOCKS == 1:
        return first, first, first, first
    elif STEP_BLOCKS == 2:
        second = _block_from_ring(rows, 1, e1, LANES)
        return first, second, second, second
    else:
        return (first, _block_from_ring(rows, 1, e1, LANES), _block_from_ring(rows, 2, e2, LANES),
                _block_from_ring(rows, 3, e3, LANES))


@gluon.jit
def _prepare_activation(x_ptr, act_ptr, act_scale_ptr, M, stride_x, k_begin, blocks, TOKENS: gl.constexpr,
                        WARPS: gl.constexpr, PREP_BLOCKS: gl.constexpr, QUANTIZE: gl.constexpr):
    """This program's K range of the activation into its scratch area, as ``triton_mma_gemv`` writes it:
    f16 values ``[block, token, 32]`` and fp32 scales ``[block, token]`` (absent tokens' too)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])  # [token, block, 32]
    per_block: gl.constexpr = gl.SliceLayout(2, layout)  # [token, block]
    tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, per_block))[:, None]
    prep_blocks = gl.arange(0, PREP_BLOCKS, layout=gl.SliceLayout(0, per_block))[None, :]
    columns = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    for b0 in range(0, blocks, PREP_BLOCKS):
        block = b0 + prep_blocks  # [1, PREP_BLOCKS], local to the split
        cols = k_begin + block[:, :, None] * 32 + columns
        valid = ((tokens < M) & (block < blocks))[:, :, None]
        x = gl.load(x_ptr + tokens[:, :, None] * stride_x + cols, mask=valid, other=0.0).to(gl.float32)
        if QUANTIZE:
            values, act_scale = quantize_blocks(x)  # [TOKENS, PREP_BLOCKS, 32], [TOKENS, PREP_BLOCKS]
        else:
            values, act_scale = _f16_blocks(x)
        gl.store(act_ptr + ((block * TOKENS + tokens) * 32)[:, :, None] + columns, values.to(gl.float16), mask=valid)
        gl.store(act_scale_ptr + block * TOKENS + tokens, act_scale, mask=(block < blocks) & (tokens >= 0))


@gluon.jit
def _ring_mma_gemv_kernel(w_desc, w2_desc, s_ptr, s2_ptr, x_ptr, out_ptr, part_ptr, counter_ptr, act_ptr,
                          act_scale_ptr, M, N, N2, stride_x, k_per_split, splits, width,
                          K: gl.constexpr, TOKENS: gl.constexpr, WARPS: gl.constexpr, STEP_BLOCKS: gl.constexpr,
                          STAGES: gl.constexpr, PREP_BLOCKS: gl.constexpr, QUANTIZE: gl.constexpr,
                          PARTIAL: gl.constexpr, PDL: gl.constexpr, RING_LAYOUT: gl.constexpr,
                          WORDS_LAYOUT: gl.constexpr):
    pid_w, split, group = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    TILE: gl.constexpr = 32 * WARPS  # weight rows per program
    # [WARPS, 8, 4] with one element per thread: warp w, lane (g, t) = 4g + t holds [w, g, t]
    lanes: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
    # the first weight's row tiles, then the second's (its outputs follow the first's columns)
    tiles = gl.cdiv(N, TILE)
    second = pid_w >= tiles
    if second:
        scales, tile, first_col, n, row = s2_ptr, pid_w - tiles, N, N2, (pid_w - tiles) * TILE
    else:
        scales, tile, first_col, n = s_ptr + group * (N // 32) * (K // 32), pid_w, group * N, N
        row = group * N + pid_w * TILE
    k_begin = split * k_per_split
    k_end = gl.minimum(k_begin + k_per_split, K)
    blocks = (k_end - k_begin) // 32
    steps = blocks // STEP_BLOCKS

    # 1. the ring, and its first STAGES steps asked for: they wait for nothing
    ring = gl.allocate_shared_memory(gl.uint8, [STAGES, TILE, STEP_BLOCKS * 32], RING_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    for s in gl.static_range(STAGES):
        if s < steps:
            _fetch_step(w_desc, w2_desc, second, ring, ready, s, row, k_begin, STEP_BLOCKS, STAGES, TILE)
    wait_for_previous_kernel(PDL)  # the activation and the scratch below may be an earlier kernel's
    let_next_kernel_start(PDL)

    # 2. this program's K range of the activation (triton_mma_gemv's scratch layout)
    program = (group * gl.num_programs(0) + pid_w) * splits + split
    act_ptr += program * (k_per_split // 32) * TOKENS * 32
    act_scale_ptr += program * (k_per_split // 32) * TOKENS
    _prepare_activation(x_ptr + group * K, act_ptr, act_scale_ptr, M, stride_x, k_begin, blocks, TOKENS, WARPS,
                        PREP_BLOCKS, QUANTIZE)
    cta_barrier()  # every thread's part of the scratch written before any lane loads from it

    # 3. each lane's place, one element per thread (triton_mma_gemv's fragments)
    zeros = gl.zeros([WARPS, 8, 4], gl.int32, lanes)
    warp = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, lanes)))[:, None, None] + zeros
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, lanes)))[None, :, None] + zeros
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, lanes)))[None, None, :] + zeros
    warp_row = tile * TILE + warp * 32
    live = warp_row < n  # N is whole 32-row blocks: a warp's rows all exist or none does
    w_exps = scales + gl.minimum(warp_row, n - 32) // 32 * (K // 32) + k_begin // 32
    x_words = act_ptr.to(gl.pointer_type(gl.int64), bitcast=True) + gl.minimum(g, M - 1) * 8 + 2 * t
    scale_words = act_scale_ptr.to(gl.pointer_type(gl.int64), bitcast=True) + gl.minimum(t, TOKENS // 2 - 1)

    # 4. the steps: the next step's activation and scale exponents loaded before this step's wait, the slot
    # asked for again (step + STAGES) once every thread has read it, then the products
    zero = gl.zeros([WARPS, 8, 4], gl.float32, lanes)
    sums = (zero, zero, zero, zero, zero, zero, zero, zero)
    x_next = _load_step(_block_activation, (x_words, scale_words), 0, TOKENS, STEP_BLOCKS)
    e_next = _load_step(_block_exponent, w_exps, 0, 0, STEP_BLOCKS)
    for step in range(steps):
        x_step, e_step = x_next, e_next
        later = gl.minimum(step + 1, steps - 1) * STEP_BLOCKS  # (the last step loads its own again)
        x_next = _load_step(_block_activation, (x_words, scale_words), later, TOKENS, STEP_BLOCKS)
        e_next = _load_step(_block_exponent, w_exps, later, 0, STEP_BLOCKS)
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        w_step = _step_from_ring(ring, slot, e_step, WARPS, lanes, STEP_BLOCKS, WORDS_LAYOUT)
        cta_barrier()  # the slot is read by all: it may be written again
        if step + STAGES < steps:
            _fetch_step(w_desc, w2_desc, second, ring, ready, step + STAGES, row, k_begin, STEP_BLOCKS, STAGES,
                        TILE)
        sums = _add_step(sums, w_step, x_step, STEP_BLOCKS, False)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    # 5. each lane's eight sums to their places: [splits, M, width] fp32 partials or the bf16 output
    destination = part_ptr + split * M * width if PARTIAL else out_ptr
    store_lane_sums(destination, sums, t, first_col + warp_row + g, width, M, live, PARTIAL, False)
    if PARTIAL:
        counter_ptr += group * gl.num_programs(0) + pid_w
        if last_to_arrive(counter_ptr, splits):
            out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
            tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, out_layout))
            tile_rows = tile * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, out_layout))
            places = tokens[:, None] * width + (first_col + tile_rows)[None, :]
            mask = (tokens < M)[:, None] & (tile_rows < n)[None, :]
            total = sum_partials(part_ptr + places, splits, M * width, mask)
            gl.store(out_ptr + places, to_bf16(total, False), mask=mask)
            reset_counter(counter_ptr)


def ring_layouts(step_blocks: int) -> tuple[gl.NVMMASharedLayout, gl.SwizzledSharedLayout]:
    """A ring slot's layout for the TMA (rows of ``32 * step_blocks`` bytes, 16-byte chunks swizzled across
    rows as wide as the row) and the same bytes as 8-byte words ``[w, r, word]`` for the lanes' reads:
    the hardware's swizzle of ``S`` bytes puts 16-byte chunk ``c`` of row ``r`` at ``c ^ ((r // (128 / S)) %
    (S / 16))``, the generic swizzle of 2-word vectors with those phases. Without the swizzle, rows of 64 or
    128 bytes would put a warp's eight rows on the same banks; rows of 32 bytes need none."""
    row_bytes = BLOCK * step_blocks
    if step_blocks == 1:
        return (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2),
                gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    return (gl.NVMMASharedLayout(swizzle_byte_width=row_bytes, element_bitwidth=8, rank=2),
            gl.SwizzledSharedLayout(2, 128 // row_bytes, row_bytes // 16, [2, 1, 0]))


def _descriptor(values: torch.Tensor, rows: int, step_blocks: int) -> TensorDescriptor:
    """A TMA descriptor of an FP8 weight ``[rows, K]``, one box per loop step of a program."""
    values = values.view(torch.uint8)
    return TensorDescriptor(values, list(values.shape), list(values.stride()), [rows, BLOCK * step_blocks],
                            ring_layouts(step_blocks)[0])


def launch_ring(grid: tuple[int, int, int], x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
                out: torch.Tensor, partials: torch.Tensor, act: torch.Tensor, act_scales: torch.Tensor, m: int, n: int,
                n2: int, k_per_split: int, splits: int, width: int, k: int, tokens: int, quantize: bool,
                cfg: DecodeConfig, pdl: bool) -> None:
    """The kernel over ``triton_mma_gemv.fp8_mma_gemv``'s grid, outputs, scratch and split, ``cfg.num_stages``
    steps in the ring (the caller checked ``ring_takes`` for each weight)."""
    (values, scales), second = weights[0], weights[1:]
    step_blocks = cfg.block_k // BLOCK
    w_desc = _descriptor(values, cfg.block_w, step_blocks)
    w2_desc, s2 = (_descriptor(second[0][0], cfg.block_w, step_blocks), second[0][1]) if second else (w_desc, scales)
    ring_layout, words_layout = ring_layouts(step_blocks)
    _ring_mma_gemv_kernel[grid](
        w_desc, w2_desc, scales.view(torch.uint8), s2.view(torch.uint8), x, out, partials,
        split_counters(x.device, grid[0] * grid[2]), act, act_scales, m, n, n2, x.stride(0), k_per_split, splits,
        width, K=k, TOKENS=tokens, WARPS=cfg.num_warps, STEP_BLOCKS=step_blocks, STAGES=cfg.num_stages,
        PREP_BLOCKS=activation_prep_blocks(k_per_split), QUANTIZE=quantize, PARTIAL=splits > 1,
        RING_LAYOUT=ring_layout, WORDS_LAYOUT=words_layout, num_warps=cfg.num_warps, **launch_arguments(pdl, x.device))
