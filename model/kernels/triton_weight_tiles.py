"""A stored weight's tiles, read in their storage format and expanded in registers.

Format codes (``FORMAT_CODES``, a kernel's ``B_FMT``): 0 = FP8 (e4m3 bytes, one UE8M0 scale per
32x32 tile), 1 = FP4 (packed e2m1, element 2k in the low nibble, one UE8M0 scale per row and 32
columns), 2 = plain bf16, 3 = FP4 in the fragment layout (``fp4_fragments.py``). ``weight_rows``
gives a tile of whole weight rows as bf16 with the scales applied, which is exact (e4m3 or e2m1 times
a power of two): the operand of the decode-form products and of the experts' kernels (the decode
form reads the tile's scale bytes apart, ``row_exponents``, as 32-bit words that join the weight's
asynchronous copies, and expands with them, ``scaled_rows``);
``fragment_tile`` gives the same tile of a matrix in the fragment layout, at ~2 instructions per
value instead of ~7; ``e4m3_words_to_f32`` expands FP8 weights loaded as int32 words to fp32 (the
one-token products, ``triton_gemv``) at 1.5 instructions per value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..config import WeightFormat

FORMAT_CODES = {WeightFormat.FP8: 0, WeightFormat.FP4: 1, WeightFormat.BF16: 2}
FP4_FRAGMENTS = tl.constexpr(3)  # a kernel's B_FMT for FP4 weights in the fragment layout


def format_code(weight) -> int:
    """``B_FMT`` of a ``QuantizedWeight``."""
    return FP4_FRAGMENTS.value if weight.fragments else FORMAT_CODES[weight.fmt]


@triton.jit
def weight_rows(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """bf16 ``[BLOCK_W, BLOCK_K]``: weight rows ``offs_w``, columns ``k0..`` (``k0`` a multiple of 32),
    scales applied; zero past row N or column K. ``EVEN_K``: K is a multiple of BLOCK_K, so no column
    mask, which would cut the loads into single bytes that the compiler cannot stream ahead."""
    exponents = row_exponents(s_ptr, offs_w, k0, N, K, stride_sn, B_FMT, BLOCK_W, BLOCK_K, False)
    return scaled_rows(w_ptr, exponents, offs_w, k0, N, K, stride_wn, B_FMT, BLOCK_W, BLOCK_K, EVEN_K, INTERPRETED)


@triton.jit
def row_exponents(s_ptr, offs_w, k0, N, K, stride_sn, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """``[BLOCK_W, BLOCK_K / 32]``: the UE8M0 scale bytes of weight rows ``offs_w``, columns ``k0..``
    (zero past row N or column K; none for bf16).

    ``WORDS`` (``scale_words``): loaded as 32-bit words, four blocks each, and split into bytes. Single
    bytes are too narrow for the compiler's asynchronous copies: loaded in the step that uses them, each
    step waits for them the whole latency of a global load, where words join the weight's pipeline."""
    scale_rows = offs_w // 32 if B_FMT == 0 else offs_w  # FP8: one per 32x32 tile; FP4: one per row and 32
    if B_FMT == 2:
        exponents = tl.zeros((BLOCK_W, BLOCK_K // 32), dtype=tl.uint8)
    elif WORDS:
        word_cols = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        words = tl.load(s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                        + scale_rows[:, None] * (stride_sn // 4) + word_cols[None, :],
                        mask=offs_w[:, None] < N, other=0)
        parts = (words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255  # little-endian: block 4w first
        exponents = tl.reshape(parts, (BLOCK_W, BLOCK_K // 32)).to(tl.uint8)
    else:
        blocks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exponents = tl.load(s_ptr + scale_rows[:, None] * stride_sn + blocks[None, :],
                            mask=(offs_w[:, None] < N) & (blocks[None, :] * 32 < K), other=0)
    return exponents


def scale_words(scales, k: int, block_k: int) -> bool:
    """Whether ``row_exponents`` may read these scales (rows of ``k / 32`` bytes) as 32-bit words in steps
    of ``block_k`` columns: whole words per step and per row, from a 4-byte aligned start."""
    return block_k % 128 == 0 and k % block_k == 0 and scales.data_ptr() % 4 == 0 and scales.stride(0) % 4 == 0


@triton.jit
def scaled_rows(w_ptr, exponents, offs_w, k0, N, K, stride_wn, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``weight_rows`` with the tile's scale bytes given (``row_exponents``)."""
    row_mask = offs_w[:, None] < N
    if B_FMT == 2:
        cols = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_ptr + offs_w[:, None] * stride_wn + cols[None, :],
                       mask=row_mask if EVEN_K else row_mask & (cols[None, :] < K), other=0.0)
    else:
        if B_FMT == 0:
            cols = k0 + tl.arange(0, BLOCK_K)
            raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + cols[None, :],
                          mask=row_mask if EVEN_K else row_mask & (cols[None, :] < K), other=0)
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            bias = 0
        else:
            cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + cols[None, :],
                          mask=row_mask if EVEN_K else row_mask & (cols[None, :] * 2 < K), other=0)
            low, high = e2m1_bytes_to_fp16(raw, INTERPRETED)
            values = tl.reshape(tl.join(low, high), (BLOCK_W, BLOCK_K)).to(tl.float32)  # low nibble first
            bias = 14  # the fp16 form is the e2m1 value times 2**-14
        scale = ((exponents.to(tl.int32) + bias) << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
        tile = tl.reshape(values, (BLOCK_W, BLOCK_K // 32, 32)) * scale[:, :, None]
        tile = tl.reshape(tile, (BLOCK_W, BLOCK_K)).to(tl.bfloat16)
    return tile


@triton.jit
def e2m1_bytes_to_fp16(raw, INTERPRETED: tl.constexpr):
    """uint8 tensor of packed e2m1 pairs -> (fp16 of the low nibbles, fp16 of the high nibbles), each
    the e2m1 value times 2**-14: the 4-bit code (s, e1 e0, m) placed in fp16's sign and lowest
    exponent/mantissa bits is exactly that, subnormals included."""
    if INTERPRETED:  # no inline assembly in the interpreter: the same bits with tensor operations
        raw = raw.to(tl.int32)
        low = (((raw & 8) << 12) | ((raw & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        high = (((raw & 0x80) << 8) | ((raw & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        low, high = _e2m1_nibbles_ptx(raw)
    return low, high


def _e2m1_pair_ptx(selector: str, low_out: str, high_out: str) -> str:
    """PTX for two bytes of the packed input ($4): a byte permute puts them in the two 16-bit lanes
    of a register; then each lane's low nibble goes to ``low_out`` and its high nibble to
    ``high_out``, sign bit to bit 15 and magnitude bits to bits 11..9."""
    return f"""
        prmt.b32 t, $4, 0, {selector};
        shl.b32 a, t, 12;
        and.b32 a, a, 0x80008000;
        shl.b32 b, t, 9;
        and.b32 b, b, 0x0E000E00;
        or.b32 {low_out}, a, b;
        shl.b32 a, t, 8;
        and.b32 a, a, 0x80008000;
        shl.b32 b, t, 5;
        and.b32 b, b, 0x0E000E00;
        or.b32 {high_out}, a, b;"""


# bytes 0,1 -> $0 (low nibbles) and $2 (high nibbles); bytes 2,3 -> $1 and $3
_E2M1_PTX = tl.constexpr("{ .reg .b32 t, a, b;" + _e2m1_pair_ptx("0x4140", "$0", "$2")
                         + _e2m1_pair_ptx("0x4342", "$1", "$3") + " }")


@triton.jit
def _e2m1_nibbles_ptx(raw):
    """uint8 tensor -> (fp16 of its low nibbles, fp16 of its high nibbles), each e2m1 code
    (s, e1 e0, m) placed in fp16's sign bit and bits 11..9: the e2m1 value times 2**-14.

    Inline PTX, 4 bytes per call, five instructions per pair of values (``_e2m1_pair_ptx``): fewer
    than the compiler makes of the same bit operations on tensors, which it also surrounds with
    byte shuffles to interleave the nibbles."""
    return tl.inline_asm_elementwise(asm=_E2M1_PTX, constraints="=r,=r,=r,=r,r", args=[raw],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def e4m3_words_to_f32(words, INTERPRETED: tl.constexpr):
    """int32 tensor, each word four e4m3 bytes (the first in the low byte) -> the fp32 values of its
    bytes 0, 1, 2 and 3: four tensors of the words' shape (exact)."""
    if INTERPRETED:  # no inline assembly in the interpreter: the same values with tensor operations
        return _e4m3_byte(words, 0), _e4m3_byte(words, 8), _e4m3_byte(words, 16), _e4m3_byte(words, 24)
    else:
        return tl.inline_asm_elementwise(asm=_E4M3_PTX, constraints="=r,=r,=r,=r,r", args=[words],
                                         dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _e4m3_byte(words, shift: tl.constexpr):
    """fp32 value of the e4m3 byte at bit ``shift`` of each word."""
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


# one word ($4, byte i = value i) -> four fp32 ($0..$3): each pair of bytes to two fp16 by one
# conversion, each fp16 to fp32 by another (both exact). Loaded as bytes, the compiler's own
# expansion moves every byte to a register of its own and packs the pairs back first (~5
# instructions per value instead of 1.5)
_E4M3_PTX = tl.constexpr("""{
    .reg .b16 lo, hi, h0, h1, h2, h3;
    .reg .b32 p01, p23;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 p01, lo;
    cvt.rn.f16x2.e4m3x2 p23, hi;
    mov.b32 {h0, h1}, p01;
    mov.b32 {h2, h3}, p23;
    cvt.f32.f16 $0, h0;
    cvt.f32.f16 $1, h1;
    cvt.f32.f16 $2, h2;
    cvt.f32.f16 $3, h3;
}""")


# ---------------------------------------------------------------------------- the fragment layout
def fragment_scales_ptx(pair: str, row_g: str, row_g8: str) -> str:
    """PTX: the scale bytes of rows g (the low byte of the b32 register ``pair``) and g + 8 (its next
    byte) -> bf16 ``2**(e - 1)`` in both halves of ``row_g`` and ``row_g8``: ``(e + 126) << 7``, by a
    byte permute and one multiply-add each."""
    return f"""
    prmt.b32 {row_g}, {pair}, 0, 0x4040;
    mad.lo.u32 {row_g}, {row_g}, 128, 0x3F003F00;
    prmt.b32 {row_g8}, {pair}, 0, 0x4141;
    mad.lo.u32 {row_g8}, {row_g8}, 128, 0x3F003F00;"""


def fragment_word_ptx(word: str, row_g: str, row_g8: str, registers: tuple[str, str, str, str]) -> str:
    """PTX: one fragment word (``fp4_fragments.py``) -> its four bf16x2 registers, scales applied. Each
    pair of codes becomes bf16 e2m1 x 2**-126 by a shift and a mask (pair 3: three of each), times its
    row's factor from ``fragment_scales_ptx``: exact (fp4_fragments). Uses b32 temporaries p and q."""
    r0, r1, r2, r3 = registers
    return f"""
    and.b32 p, {word}, 0x81C081C0;
    mul.rn.bf16x2 {r0}, p, {row_g};
    shl.b32 p, {word}, 3;
    and.b32 p, p, 0x81C081C0;
    mul.rn.bf16x2 {r1}, p, {row_g8};
    shl.b32 p, {word}, 6;
    and.b32 p, p, 0x81C081C0;
    mul.rn.bf16x2 {r2}, p, {row_g};
    shl.b32 p, {word}, 1;
    and.b32 p, p, 0x80008000;
    shr.b32 q, {word}, 3;
    and.b32 q, q, 0x01800180;
    or.b32 p, p, q;
    shr.b32 q, {word}, 7;
    and.b32 q, q, 0x00400040;
    or.b32 p, p, q;
    mul.rn.bf16x2 {r3}, p, {row_g8};"""


# $4: one word (the fragment's 8 codes); $5: 16 bits, the scale bytes of rows g (low) and g + 8 (high).
# One word in, its four registers out, whatever layout the compiler gives the tensors.
_FRAGMENT_PTX = tl.constexpr("{ .reg .b32 p, q, s, sg, sh; cvt.u32.u16 s, $5;"
                             + fragment_scales_ptx("s", "sg", "sh")
                             + fragment_word_ptx("$4", "sg", "sh", ("$0", "$1", "$2", "$3")) + " }")


@triton.jit
def fragment_column(col):
    """Where column ``col`` of an activation row goes when the row is stored in the fragment layout's
    column order: within each group of 64, lane t's 16 columns of the four 16-column steps
    (``16 c + 8 j + 2 t + b``, the K slots of its B fragments) become 16 consecutive values
    ``16 t + 4 c + 2 j + b``, so a lane loads a step's B fragments as one 8-byte word
    (``triton_mma_experts``; twin: ``fp4_fragments.fragment_column_order``)."""
    return (col & -64) | (((col >> 1) & 3) << 4) | (((col >> 4) & 3) << 2) | (((col >> 3) & 1) << 1) | (col & 1)


@triton.jit
def fragment_offsets(K, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """Offsets of a ``[BLOCK_W, BLOCK_K]`` tile's words (int32 units, ``[BLOCK_W/16, BLOCK_K/64 * 128]``:
    each row group's words for the tile are contiguous, so they load in 16-byte vectors) and of its
    scale pairs (int16 units, ``[BLOCK_W/16, BLOCK_K/64, 8, 1, 4]``, broadcast over the words that share
    them), from the tile's first row and column; a K step of ``BLOCK_K`` columns moves them by
    ``BLOCK_K / 64 * 128`` and ``BLOCK_K / 64 * 16``."""
    RG: tl.constexpr = BLOCK_W // 16
    KQ: tl.constexpr = BLOCK_K // 64
    words = tl.arange(0, RG)[:, None] * (K // 64 * 128) + tl.arange(0, KQ * 128)[None, :]
    rg = tl.arange(0, RG)[:, None, None, None, None]
    kq = tl.arange(0, KQ)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    c = tl.arange(0, 4)[None, None, None, None, :]
    scales = rg * (K // 32 * 8) + (kq * 2 + c // 2) * 8 + g  # [N/16, K/32, g, h] bytes = [.., g] int16
    return words, scales


@triton.jit
def fragment_tile(w_ptr, s_ptr, words, scales, groups, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """bf16 ``[BLOCK_W, BLOCK_K]``, scales applied: the tile at ``w_ptr``/``s_ptr`` (its first word and
    scale byte) of an FP4 matrix in the fragment layout; ``words``/``scales`` from ``fragment_offsets``;
    rows past the first ``groups`` row groups of 16 are zero."""
    RG: tl.constexpr = BLOCK_W // 16
    KQ: tl.constexpr = BLOCK_K // 64
    word = tl.load(w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + words,
                   mask=tl.arange(0, RG)[:, None] < groups, other=0)
    word = tl.reshape(word, (RG, KQ, 8, 4, 4))  # [rg, kq, g, t, c]
    pair = tl.load(s_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + scales,
                   mask=tl.arange(0, RG)[:, None, None, None, None] < groups, other=0)
    pair = tl.broadcast_to(pair, (RG, KQ, 8, 4, 4))
    if INTERPRETED:  # no inline assembly: the same bits with tensor operations
        r0, r1, r2, r3 = fragment_registers(word, pair)
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(asm=_FRAGMENT_PTX, constraints="=r,=r,=r,=r,r,h",
                                                   args=[word, pair], dtype=(tl.int32,) * 4, is_pure=True,
                                                   pack=1)
    # register 2 j + h holds row 16 rg + 8 h + g, columns 64 kq + 16 c + 8 j + 2 t + (0, 1)
    v = tl.join(tl.join(_bf16_pair(r0), _bf16_pair(r1)), tl.join(_bf16_pair(r2), _bf16_pair(r3)))
    v = tl.permute(v, (0, 6, 2, 1, 4, 7, 3, 5))  # [rg, kq, g, t, c, b, h, j] -> [rg, h, g, kq, c, j, t, b]
    return tl.reshape(v, (BLOCK_W, BLOCK_K))


@triton.jit
def _bf16_pair(register):
    """int32 holding two bf16 (low half first) -> bf16 ``[.., 2]``."""
    low = register.to(tl.int16).to(tl.bfloat16, bitcast=True)
    high = (register >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(low, high)


_PAIR_MASK = tl.constexpr(0x81C081C0 - (1 << 32))  # the PTX's masks as int32 constants
_SIGN_MASK = tl.constexpr(0x80008000 - (1 << 32))


@triton.jit
def fragment_registers(word, pair):
    """The interpreter's twin of ``_FRAGMENT_PTX``: the four registers, from the same bits (the products
    by the scales in fp32, exact: the results are normal bf16 values)."""
    m = _PAIR_MASK
    p3 = ((word << 1) & _SIGN_MASK) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040)
    e = pair.to(tl.int32) & 0xFFFF
    return (_scaled(word & m, e & 0xFF), _scaled((word << 3) & m, e >> 8), _scaled((word << 6) & m, e & 0xFF),
            _scaled(p3, e >> 8))


@triton.jit
def _scaled(bits, e):
    """Both bf16 halves of ``bits`` (e2m1 x 2**-126) times 2**(e - 1), as int32 bf16 bits."""
    factor = ((e + 126) << 23).to(tl.float32, bitcast=True)
    low = ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True) * factor
    high = (bits & -65536).to(tl.float32, bitcast=True) * factor
    return ((low.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (high.to(tl.int32, bitcast=True) & -65536)
