"""The routed experts of a few pairs each on the tensor cores, fed straight from registers.

``mma_experts(x, pair_token, pair_expert, pair_weight, experts)``: ``triton_moe.fused_experts``'s
contract (the routed experts' outputs ``[P, D]`` bf16 of (token, expert) pairs) for FP4 experts in the
fragment layout (``fp4_fragments.py``), in blocks of at most 8 pairs of one expert.

Why: ``triton_moe``'s kernels expand each weight tile in registers, then hand it to the warpgroup
instructions (``wgmma``) with the tokens staged in shared memory. Compiled for sm_90 (16 tokens x 128
rows, 4 warps) their loop takes ~3.4 SASS instructions per weight value, ~6.9 per weight byte; an
H200 SM must take ~16 bytes of weight per cycle to run at the memory bandwidth, which leaves about
8 instructions per byte and thread at full issue: at the decode shapes those kernels are bound by
instruction issue (two thirds of the bandwidth at 64-256 tokens; docs/benchmarks-log.md). Here each lane
loads its own fragment words, expands them (``triton_weight_tiles.fragment_word_ptx``: a shift, a mask
and a bf16 multiply per pair of values) and issues ``mma.sync.m16n8k16`` on them directly: no shared
memory, no warpgroup synchronisation, the scale factors made once per 32 columns instead of once per
word. The product's 8 columns are a block's 8 pairs.

Work: each warp owns four 16-row groups of the weight: the gate/up kernel the same 32 rows of ``w1``
and of ``w3``, the down kernel 64 rows of ``w2``. A loop step is 64 columns: per group a lane's four
words, 16 contiguous bytes (``fp4_fragments``: 64 consecutive columns' words of a lane are
contiguous), and the two 16-bit scale pairs of its rows; the lane's B fragments (pair g's activation at
the K slots its words hold) are 32 contiguous bytes, because the activation rows are stored in the
fragment layout's column order (``triton_weight_tiles.fragment_column``: by ``act_quant_bf16`` for the
tokens, by the gate/up kernel itself for its output). Triton compiles those loads to 8-byte loads (two
and four per lane); a 16-byte load in PTX came within 3% of them on one H100 and changed nothing in the
engine's decode (docs/benchmarks-log.md). Loads are issued one step ahead of their use.

A step of at most ``tile_configs.MMA_EXPERTS_UNSORTED_PAIRS`` pairs (one token's) skips the pair sort
(``triton_moe.align_pairs``): each pair is a block of its own, in pair order, and the kernels read the
pairs' experts directly (``UNSORTED``); the down kernel then zeroes the rows of pairs of no local
expert, which the sort would have zeroed. The sort is one program that runs alone between the
activation's quantization and gate/up; at one token its blocks would hold one pair each anyway.

K is split so that enough warps stream the weight (``split_count``); every split stores its fp32
partial sums per pair and the last to arrive adds them in split order (``triton_split_sums``). The
gate/up kernel always goes through those partials: its epilogue (``triton_moe.hidden_round_trip``,
bf16 roundings, clamped SwiGLU, routing weight, the FP8 round trip per 32 features) works on ordinary
tensors, which the lanes' sums only reach through memory. The down kernel's lanes store their bf16
outputs themselves when K is not split.

Arithmetic: every product is exact (e2m1 times its power-of-two scale in bf16, times the bf16 of an FP8
round trip) and the fp32 sums run in the tensor cores' order, as in ``triton_moe`` but for that order,
so the outputs meet the same tolerance against the reference. Not batch invariant (the split and the
kernel chosen depend on the batch): used outside ``--batch-invariant`` only, and only up to
``tile_configs.MMA_EXPERTS_MAX_PAIRS`` pairs per expert on average.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import tile_configs
from .fp4_fragments import FRAGMENT_COLS
from .tile_configs import mma_experts_config
from .triton_common import INTERPRETED, sm_count, to_bf16
from .triton_decode_mm import split_count
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_moe import align_pairs, hidden_round_trip
from .triton_scaled_mm import act_quant_bf16
from .triton_split_sums import last_to_arrive, reset_counter, split_counters, sum_partials
from .triton_warp_fragments import emulated_mma_bf16, warp_lanes
from .triton_weight_tiles import fragment_column, fragment_registers, fragment_scales_ptx, fragment_word_ptx
from .weights import ExpertWeights, QuantizedWeight

MAX_PAIRS = 8  # pairs per block: the token columns of one tensor-core product
GROUP_ROWS = 16  # rows of one fragment group (the product's 16-row side)
ROWS_PER_WARP = 4 * GROUP_ROWS  # four groups per warp: 32 rows of w1 and of w3, or 64 of w2
STEP = FRAGMENT_COLS  # K columns per loop step: a lane's four words of one group
# the same numbers as the kernels read them
_MAX_PAIRS, _GROUP_ROWS = tl.constexpr(MAX_PAIRS), tl.constexpr(GROUP_ROWS)
_ROWS_PER_WARP, _STEP = tl.constexpr(ROWS_PER_WARP), tl.constexpr(STEP)


def _tile_step_ptx() -> str:
    """One 64-column step of one 16-row group: $4, $5 the lane's four words (two per b64); $6, $7 the
    scale pairs of rows g and g + 8 for the step's two 32-column blocks; $8..$11 pair g's activation at
    the four 16-column steps' K slots (two bf16 pairs each); $12..$15 the running sums of (row g, pair
    2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), which $0..$3 return."""
    words = "".join(fragment_word_ptx(f"w{i}", f"sg{i // 2}", f"sh{i // 2}",
                                      tuple(f"a{4 * i + r}" for r in range(4))) for i in range(4))
    products = []
    for c in range(4):
        into = "{$0, $1, $2, $3}" if c == 3 else "{d0, d1, d2, d3}"
        start = "{$12, $13, $14, $15}" if c == 0 else "{d0, d1, d2, d3}"
        products.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {into}, "
                        f"{{a{4 * c}, a{4 * c + 1}, a{4 * c + 2}, a{4 * c + 3}}}, {{x{2 * c}, x{2 * c + 1}}}, {start};")
    return ("{\n.reg .b32 p, q, s, sg0, sh0, sg1, sh1, w<4>, a<16>, x<8>;\n.reg .f32 d<4>;\n"
            "mov.b64 {w0, w1}, $4;\nmov.b64 {w2, w3}, $5;\n"
            + "".join(f"mov.b64 {{x{2 * c}, x{2 * c + 1}}}, ${8 + c};\n" for c in range(4))
            + "cvt.u32.u16 s, $6;" + fragment_scales_ptx("s", "sg0", "sh0")
            + "\ncvt.u32.u16 s, $7;" + fragment_scales_ptx("s", "sg1", "sh1")
            + words + "\n" + "\n".join(products) + "\n}")


_TILE_STEP_PTX = tl.constexpr(_tile_step_ptx())


@triton.jit
def _low(word64):
    return (word64 & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _high(word64):
    return (word64 >> 32).to(tl.int32)


@triton.jit
def _tile_step(s0, s1, s2, s3, words01, words23, scales0, scales1, x0, x1, x2, x3, INTERPRETED: tl.constexpr):
    """``_TILE_STEP_PTX``: one step of one 16-row group added to a lane's four running sums."""
    if INTERPRETED:  # the four products at once: word c with scale pair c // 2 and activation word c
        words = tl.reshape(tl.join(tl.join(_low(words01), _high(words01)), tl.join(_low(words23), _high(words23))),
                           (s0.shape[0], 4))
        pairs = tl.reshape(tl.join(tl.join(scales0, scales0), tl.join(scales1, scales1)), (s0.shape[0], 4))
        x = tl.reshape(tl.join(tl.join(x0, x1), tl.join(x2, x3)), (s0.shape[0], 4))
        a0, a1, a2, a3 = fragment_registers(words, pairs)
        return emulated_mma_bf16(a0, a1, a2, a3, _low(x), _high(x), s0, s1, s2, s3, s0.shape[0])
    else:
        return tl.inline_asm_elementwise(
            asm=_TILE_STEP_PTX, constraints="=f,=f,=f,=f,l,l,h,h,l,l,l,l,f,f,f,f",
            args=[words01, words23, scales0, scales1, x0, x1, x2, x3, s0, s1, s2, s3], dtype=(tl.float32,) * 4,
            is_pure=False, pack=1)


@triton.jit
def _load_group(words, scales):
    """A lane's operands of one step of one 16-row group: its four words (two b64) and the scale pairs
    of the step's two 32-column blocks."""
    return tl.load(words), tl.load(words + 1), tl.load(scales), tl.load(scales + 8)


@triton.jit
def _load_weights(words_a, words_b, scales_a, scales_b, GROUP_WORDS: tl.constexpr, GROUP_SCALES: tl.constexpr):
    """A lane's weight operands of one step (at the pointers): groups ``a``, ``a`` + 1, ``b``, ``b`` + 1."""
    return (_load_group(words_a, scales_a), _load_group(words_a + GROUP_WORDS, scales_a + GROUP_SCALES),
            _load_group(words_b, scales_b), _load_group(words_b + GROUP_WORDS, scales_b + GROUP_SCALES))


@triton.jit
def _load_x(x_words):
    """A lane's four activation words of one step (pair g's B fragments of its four 16-column products)."""
    return tl.load(x_words), tl.load(x_words + 1), tl.load(x_words + 2), tl.load(x_words + 3)


@triton.jit
def _load_step(words_a, words_b, scales_a, scales_b, x_words, GROUP_WORDS: tl.constexpr,
               GROUP_SCALES: tl.constexpr):
    """A lane's operands of one step: its weights' four groups and its four activation words."""
    a, a_next, b, b_next = _load_weights(words_a, words_b, scales_a, scales_b, GROUP_WORDS, GROUP_SCALES)
    return a, a_next, b, b_next, _load_x(x_words)


@triton.jit
def _add_group(sums, group, x, INTERPRETED: tl.constexpr):
    s0, s1, s2, s3 = sums
    words01, words23, scales0, scales1 = group
    x0, x1, x2, x3 = x
    return _tile_step(s0, s1, s2, s3, words01, words23, scales0, scales1, x0, x1, x2, x3, INTERPRETED)


@triton.jit
def _add_step(sums, step, INTERPRETED: tl.constexpr):
    """One step's products added to a lane's sums: four groups x (rows g, g + 8) x (pairs 2t, 2t + 1)."""
    first, second, third, fourth = sums
    a, a_next, b, b_next, x = step
    return (_add_group(first, a, x, INTERPRETED), _add_group(second, a_next, x, INTERPRETED),
            _add_group(third, b, x, INTERPRETED), _add_group(fourth, b_next, x, INTERPRETED))


@triton.jit
def _warp_sums(words_a, words_b, scales_a, scales_b, x_words, steps, K: tl.constexpr, THREADS: tl.constexpr,
               WAIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """A lane's sums of its four groups over ``steps`` steps from the pointers of the first step. Each
    step's loads are issued before the previous step's products, into two sets of registers taken in
    turn (two steps per loop iteration), so that no loaded value is copied from one to the other.
    ``WAIT``: the kernel's wait for the previous one (``triton_dependent_launch``) comes here, between
    the first step's weights and its activation (which the previous kernel writes)."""
    GROUP_WORDS: tl.constexpr = K // _STEP * 64  # one 16-row group's words, in 8-byte units
    GROUP_SCALES: tl.constexpr = K // 32 * 8  # its scale pairs, in 2-byte units
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    sums = ((zero, zero, zero, zero), (zero, zero, zero, zero), (zero, zero, zero, zero), (zero, zero, zero, zero))
    a, a_next, b, b_next = _load_weights(words_a, words_b, scales_a, scales_b, GROUP_WORDS, GROUP_SCALES)
    wait_for_previous_kernel(WAIT)
    let_next_kernel_start(WAIT)
    even = (a, a_next, b, b_next, _load_x(x_words))
    for _ in range(0, (steps - 1) // 2):
        odd = _load_step(words_a + 64, words_b + 64, scales_a + 16, scales_b + 16, x_words + 16, GROUP_WORDS,
                         GROUP_SCALES)  # a step: 512 bytes of a group's words, 32 of its scales, 128 of activation
        sums = _add_step(sums, even, INTERPRETED)
        words_a += 128
        words_b += 128
        scales_a += 32
        scales_b += 32
        x_words += 32
        even = _load_step(words_a, words_b, scales_a, scales_b, x_words, GROUP_WORDS, GROUP_SCALES)
        sums = _add_step(sums, odd, INTERPRETED)
    if steps % 2 == 0:  # one step after the last even one
        odd = _load_step(words_a + 64, words_b + 64, scales_a + 16, scales_b + 16, x_words + 16, GROUP_WORDS,
                         GROUP_SCALES)
        sums = _add_step(sums, even, INTERPRETED)
        sums = _add_step(sums, odd, INTERPRETED)
    else:
        sums = _add_step(sums, even, INTERPRETED)
    return sums


@triton.jit
def _lane_setup(block_expert_ptr, block_index_ptr, expert_start_ptr, expert_count_ptr, pid_b, E,
                WARPS: tl.constexpr, UNSORTED: tl.constexpr, INTERPRETED: tl.constexpr):
    """(expert (< 0: an unused block, or a pair of no local expert), lane, its g = lane // 4 and
    t = lane % 4, warp, the block's pair count, the sorted-list position of its first pair).
    ``UNSORTED``: block b is pair b and ``block_expert_ptr`` the pairs' experts (no sort ran)."""
    lane, warp = warp_lanes(32 * WARPS, INTERPRETED)
    expert = tl.load(block_expert_ptr + pid_b)
    if UNSORTED:
        expert = tl.where((expert >= 0) & (expert < E), expert, -1)
        return expert, lane, lane // 4, lane % 4, warp, 1, pid_b
    else:
        safe = tl.maximum(expert, 0)
        first = tl.load(block_index_ptr + pid_b) * _MAX_PAIRS
        count = tl.minimum(tl.load(expert_count_ptr + safe) - first, _MAX_PAIRS)
        return expert, lane, lane // 4, lane % 4, warp, count, tl.load(expert_start_ptr + safe) + first


@triton.jit
def _pair_ids(sorted_pair_ptr, positions, live, UNSORTED: tl.constexpr):
    """The pair ids at these positions of the sorted list (unsorted: the positions themselves)."""
    if UNSORTED:
        return positions.to(tl.int64)
    else:
        return tl.load(sorted_pair_ptr + positions, mask=live, other=0).to(tl.int64)


@triton.jit
def _lane_pairs(sorted_pair_ptr, first, count, t, UNSORTED: tl.constexpr):
    """The pairs of a lane's sum columns 2t and 2t + 1, and whether each exists."""
    live_even, live_odd = 2 * t < count, 2 * t + 1 < count
    pair_even = _pair_ids(sorted_pair_ptr, first + 2 * t, live_even, UNSORTED)
    pair_odd = _pair_ids(sorted_pair_ptr, first + 2 * t + 1, live_odd, UNSORTED)
    return pair_even, pair_odd, live_even, live_odd


@triton.jit
def _store_group(ptr, sums, row, pairs, width, live, PARTIAL: tl.constexpr, INTERPRETED: tl.constexpr):
    """A group's four sums of a lane: rows ``row``, ``row + 8`` x its two pairs, to ``ptr[pair * width +
    row]``, as fp32 partials or bf16 outputs."""
    s0, s1, s2, s3 = sums
    pair_even, pair_odd, live_even, live_odd = pairs
    if not PARTIAL:
        s0, s1, s2, s3 = (to_bf16(s0, INTERPRETED), to_bf16(s1, INTERPRETED), to_bf16(s2, INTERPRETED),
                          to_bf16(s3, INTERPRETED))
    tl.store(ptr + pair_even * width + row, s0, mask=live_even & live)
    tl.store(ptr + pair_odd * width + row, s1, mask=live_odd & live)
    tl.store(ptr + pair_even * width + row + 8, s2, mask=live_even & live)
    tl.store(ptr + pair_odd * width + row + 8, s3, mask=live_odd & live)


@triton.jit
def _gate_up_kernel(x_ptr, pair_token_ptr, pair_weight_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr,
                    block_expert_ptr, block_index_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, part_ptr,
                    counter_ptr, P, E, stride_we, stride_se, limit, steps_per_split, splits,
                    D: tl.constexpr, INTER: tl.constexpr, WARPS: tl.constexpr, UNSORTED: tl.constexpr,
                    PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_w, pid_b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # sorted: even the expert to read comes from the previous kernel (the sort), so the wait comes
    # first; unsorted: the previous kernel (the activation's quantization) writes only x, and the
    # experts come from the routing before it, so the first weights are loaded before the wait
    EARLY: tl.constexpr = PDL and UNSORTED
    wait_for_previous_kernel(PDL and not UNSORTED)
    let_next_kernel_start(PDL and not UNSORTED)
    expert, lane, g, t, warp, count, first = _lane_setup(block_expert_ptr, block_index_ptr, expert_start_ptr,
                                                         expert_count_ptr, pid_b, E, WARPS, UNSORTED, INTERPRETED)
    if expert < 0:
        return
    TILE: tl.constexpr = 32 * WARPS  # rows of w1 (and the same rows of w3) per program
    row0 = pid_w * TILE + warp * 32  # the warp's 32 rows (INTER is whole tiles)
    step0 = split * steps_per_split
    steps = tl.minimum(steps_per_split, D // _STEP - step0)
    e = expert.to(tl.int64)
    # pair g's token (a lane past the block's pairs reads the first pair's: those sums are not kept)
    token = tl.load(pair_token_ptr + _pair_ids(sorted_pair_ptr, first + tl.where(g < count, g, 0), lane >= 0,
                                               UNSORTED)).to(tl.int64)
    x_words = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + token * (D // 4) + step0 * 16 + t * 4
    words = e * (stride_we // 8) + (row0 // _GROUP_ROWS * (D // _STEP) + step0) * 64 + lane * 2
    scales = e * (stride_se // 2) + (row0 // _GROUP_ROWS * (D // 32) + 2 * step0) * 8 + g
    gate_rows, gate_next, up_rows, up_next = _warp_sums(
        w1_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + words,
        w3_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + words,
        s1_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + scales,
        s3_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + scales, x_words, steps, D, 32 * WARPS, EARLY,
        INTERPRETED)
    # every split's fp32 partials [splits, P, 2 * INTER]: a pair's gate sums at column r, its up at INTER + r
    pairs = _lane_pairs(sorted_pair_ptr, first, count, t, UNSORTED)
    partials = part_ptr + split * P * (2 * INTER)
    every = lane >= 0  # (INTER is whole tiles: every warp's rows exist)
    _store_group(partials, gate_rows, row0 + g, pairs, 2 * INTER, every, True, INTERPRETED)
    _store_group(partials, gate_next, row0 + 16 + g, pairs, 2 * INTER, every, True, INTERPRETED)
    _store_group(partials, up_rows, INTER + row0 + g, pairs, 2 * INTER, every, True, INTERPRETED)
    _store_group(partials, up_next, INTER + row0 + 16 + g, pairs, 2 * INTER, every, True, INTERPRETED)
    counter_ptr += pid_b * tl.num_programs(0) + pid_w
    if last_to_arrive(counter_ptr, splits):  # (one split: this program, after a barrier)
        _gate_up_epilogue(pair_weight_ptr, sorted_pair_ptr, h_ptr, part_ptr, P, limit, splits, count, first,
                          pid_w, pid_b, INTER, TILE, UNSORTED, INTERPRETED)
        reset_counter(counter_ptr)


@triton.jit
def _gate_up_epilogue(pair_weight_ptr, sorted_pair_ptr, h_ptr, part_ptr, P, limit, splits, count, first, pid_w,
                      pid_b, INTER: tl.constexpr, TILE: tl.constexpr, UNSORTED: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """The tile's gate and up sums (all splits added) -> its features of the down projection's input,
    stored at the block's rows of ``h`` in the fragment layout's column order."""
    slots = tl.arange(0, _MAX_PAIRS)
    live = slots < count
    pairs = _pair_ids(sorted_pair_ptr, first + slots, live, UNSORTED)
    rows = pid_w * TILE + tl.arange(0, TILE)
    places = part_ptr + pairs[None, :] * (2 * INTER) + rows[:, None]  # [rows, pairs]
    gate = sum_partials(places, splits, P * 2 * INTER, live[None, :])
    up = sum_partials(places + INTER, splits, P * 2 * INTER, live[None, :])
    weight = tl.load(pair_weight_ptr + pairs, mask=live, other=0.0)
    hidden = hidden_round_trip(gate, up, weight, limit, _MAX_PAIRS, TILE, INTERPRETED)  # [pairs, rows]
    h_rows = (pid_b * _MAX_PAIRS + slots).to(tl.int64)
    tl.store(h_ptr + h_rows[:, None] * INTER + fragment_column(rows)[None, :], hidden.to(tl.bfloat16),  # exact
             mask=live[:, None])


@triton.jit
def _down_kernel(h_ptr, out_ptr, sorted_pair_ptr, expert_start_ptr, expert_count_ptr, block_expert_ptr,
                 block_index_ptr, w2_ptr, s2_ptr, part_ptr, counter_ptr, P, E, stride_we, stride_se,
                 steps_per_split, splits, D: tl.constexpr, INTER: tl.constexpr, WARPS: tl.constexpr,
                 PARTIAL: tl.constexpr, UNSORTED: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    pid_w, pid_b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # unsorted: the first weights are loaded before the wait, as in gate/up (gate/up writes only h)
    EARLY: tl.constexpr = PDL and UNSORTED
    wait_for_previous_kernel(PDL and not UNSORTED)
    let_next_kernel_start(PDL and not UNSORTED)
    expert, lane, g, t, warp, count, first = _lane_setup(block_expert_ptr, block_index_ptr, expert_start_ptr,
                                                         expert_count_ptr, pid_b, E, WARPS, UNSORTED, INTERPRETED)
    TILE: tl.constexpr = _ROWS_PER_WARP * WARPS  # rows of w2 (output features) per program
    if expert < 0:
        if UNSORTED and split == 0:  # a pair of no local expert: its row is zero (no sort zeroed it)
            wait_for_previous_kernel(EARLY)  # (a store: never before the wait)
            rows = pid_w * TILE + tl.arange(0, TILE)
            tl.store(out_ptr + pid_b.to(tl.int64) * D + rows, tl.zeros((TILE,), dtype=tl.bfloat16), mask=rows < D)
        return
    warp_row = pid_w * TILE + warp * _ROWS_PER_WARP
    live = warp_row < D  # D is whole groups of 64 rows: a warp's rows all exist or none does
    row0 = tl.minimum(warp_row, D - _ROWS_PER_WARP)  # a warp past the last row reads the last rows
    step0 = split * steps_per_split
    steps = tl.minimum(steps_per_split, INTER // _STEP - step0)
    e = expert.to(tl.int64)
    # the block's row g of h (a lane past its pairs reads row 0: those sums are not kept)
    h_row = (pid_b * _MAX_PAIRS + tl.where(g < count, g, 0)).to(tl.int64)
    x_words = h_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + h_row * (INTER // 4) + step0 * 16 + t * 4
    words = w2_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + e * (stride_we // 8) \
        + (row0 // _GROUP_ROWS * (INTER // _STEP) + step0) * 64 + lane * 2
    scales = s2_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + e * (stride_se // 2) \
        + (row0 // _GROUP_ROWS * (INTER // 32) + 2 * step0) * 8 + g
    GROUP_WORDS: tl.constexpr = INTER // _STEP * 64
    GROUP_SCALES: tl.constexpr = INTER // 32 * 8
    first_rows, second_rows, third_rows, fourth_rows = _warp_sums(
        words, words + 2 * GROUP_WORDS, scales, scales + 2 * GROUP_SCALES, x_words, steps, INTER, 32 * WARPS,
        EARLY, INTERPRETED)
    pairs = _lane_pairs(sorted_pair_ptr, first, count, t, UNSORTED)
    destination = part_ptr + split * P * D if PARTIAL else out_ptr
    _store_group(destination, first_rows, row0 + g, pairs, D, live, PARTIAL, INTERPRETED)
    _store_group(destination, second_rows, row0 + 16 + g, pairs, D, live, PARTIAL, INTERPRETED)
    _store_group(destination, third_rows, row0 + 32 + g, pairs, D, live, PARTIAL, INTERPRETED)
    _store_group(destination, fourth_rows, row0 + 48 + g, pairs, D, live, PARTIAL, INTERPRETED)
    if PARTIAL:
        counter_ptr += pid_b * tl.num_programs(0) + pid_w
        if last_to_arrive(counter_ptr, splits):
            slots = tl.arange(0, _MAX_PAIRS)
            pair_live = slots < count
            pair_ids = _pair_ids(sorted_pair_ptr, first + slots, pair_live, UNSORTED)
            rows = pid_w * TILE + tl.arange(0, TILE)
            places = pair_ids[None, :] * D + rows[:, None]
            mask = pair_live[None, :] & (rows < D)[:, None]
            total = sum_partials(part_ptr + places, splits, P * D, mask)
            tl.store(out_ptr + places, to_bf16(total, INTERPRETED), mask=mask)
            reset_counter(counter_ptr)


def takes(experts: ExpertWeights) -> bool:
    """Whether these experts are in the layout and shapes the kernels read: FP4 fragments, D and the
    intermediate width whole 64-row groups and 64-column steps, the words 8-byte and the scale pairs
    2-byte aligned (a view into a larger buffer may start anywhere)."""
    weights = (experts.w1, experts.w3, experts.w2)
    if not all(isinstance(w, QuantizedWeight) and w.fragments and w.values.data_ptr() % 8 == 0
               and w.scales.data_ptr() % 2 == 0 for w in weights):
        return False
    inter, d = experts.w1.out_features, experts.w1.in_features
    return inter % STEP == 0 and d % ROWS_PER_WARP == 0  # (whole steps of K both ways; w2's row groups)


def mma_experts(x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor,
                experts: ExpertWeights, pdl: bool = False) -> torch.Tensor:
    """Routed expert outputs ``[P, D]`` bf16 of bf16 token rows ``x [N, D]`` (``fused_experts``'s
    contract), for experts that this module ``takes``; ``pdl``: its kernels (the activation's
    quantization, the pairs' sort unless the step skips it, gate/up and down) with programmatic
    dependent launch where the GPU has it (``triton_dependent_launch``)."""
    if not takes(experts):
        raise ValueError("mma_experts reads FP4 experts in the fragment layout, D and the intermediate width "
                         "multiples of 64")
    p, d = pair_token.shape[0], x.shape[1]
    out = torch.empty(p, d, dtype=torch.bfloat16, device=x.device)  # the pair sort zeroes other ranks' rows
    if p == 0:
        return out
    num_experts, inter = experts.num_experts, experts.w1.out_features
    cfg = mma_experts_config(p / num_experts)
    warps = cfg.num_warps
    while inter % (32 * warps):  # the gate/up kernel's tiles cover the intermediate rows exactly
        warps //= 2
    gate_up_tile = 32 * warps
    x = act_quant_bf16(x.contiguous(), fragment_columns=True, pdl=pdl)
    unsorted = p <= tile_configs.MMA_EXPERTS_UNSORTED_PAIRS
    if unsorted:  # block b is pair b: the kernels read the pairs' experts and nothing of a sort
        block_expert = sorted_pair = start = count = block_index = pair_expert
        num_blocks = p
    else:
        sorted_pair, start, count, block_expert, block_index = align_pairs(pair_expert, num_experts, MAX_PAIRS,
                                                                           pdl, zero_rows=out)
        num_blocks = block_expert.shape[0]
    live_blocks = min(num_experts, p)  # each expert with pairs has at least one block
    sms = sm_count(x.device)
    gate_up_cfg = dataclasses.replace(cfg, block_w=gate_up_tile, block_k=STEP, num_warps=warps)
    down_cfg = dataclasses.replace(cfg, block_w=ROWS_PER_WARP * warps, block_k=STEP, num_warps=warps)
    gate_up_splits, gate_up_k = split_count(gate_up_cfg, inter, d, live_blocks, sms)
    down_splits, down_k = split_count(down_cfg, d, inter, live_blocks, sms)
    gate_up_tiles, down_tiles = inter // gate_up_tile, triton.cdiv(d, down_cfg.block_w)
    counters = split_counters(x.device, num_blocks * max(gate_up_tiles, down_tiles))
    hidden = torch.empty(num_blocks * MAX_PAIRS, inter, dtype=torch.bfloat16, device=x.device)
    gate_up_parts = torch.empty(gate_up_splits, p, 2 * inter, dtype=torch.float32, device=x.device)
    down_parts = torch.empty(down_splits, p, d, dtype=torch.float32, device=x.device) if down_splits > 1 else out
    w1, w3, w2 = (w.values.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    s1, s3, s2 = (w.scales.view(torch.uint8) for w in (experts.w1, experts.w3, experts.w2))
    _gate_up_kernel[(gate_up_tiles, num_blocks, gate_up_splits)](
        x, pair_token, pair_weight, sorted_pair, start, count, block_expert, block_index, w1, s1, w3, s3, hidden,
        gate_up_parts, counters, p, num_experts, w1.stride(0), s1.stride(0), float(experts.swiglu_limit),
        gate_up_k // STEP, gate_up_splits, D=d, INTER=inter, WARPS=warps, UNSORTED=unsorted, INTERPRETED=INTERPRETED,
        num_warps=warps, **launch_arguments(pdl, x.device))
    _down_kernel[(down_tiles, num_blocks, down_splits)](
        hidden, out, sorted_pair, start, count, block_expert, block_index, w2, s2, down_parts, counters, p,
        num_experts, w2.stride(0), s2.stride(0), down_k // STEP, down_splits, D=d, INTER=inter, WARPS=warps,
        PARTIAL=down_splits > 1, UNSORTED=unsorted, INTERPRETED=INTERPRETED, num_warps=warps,
        **launch_arguments(pdl, x.device))
    return out
