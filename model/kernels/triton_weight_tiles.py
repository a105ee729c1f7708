"""A stored weight's tiles, read in their storage format and expanded in registers.

Format codes (``FORMAT_CODES``, a kernel's ``B_FMT``): 0 = FP8 (e4m3 bytes, one UE8M0 scale per
32x32 tile), 1 = FP4 (packed e2m1, element 2k in the low nibble, one UE8M0 scale per row and 32
columns), 2 = plain bf16. ``weight_rows`` gives a tile of whole weight rows as bf16 with the scales
applied, which is exact (e4m3 or e2m1 times a power of two): the operand of the decode-form
products and of the experts' kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..config import WeightFormat

FORMAT_CODES = {WeightFormat.FP8: 0, WeightFormat.FP4: 1, WeightFormat.BF16: 2}


@triton.jit
def weight_rows(w_ptr, s_ptr, offs_w, k0, N, K, stride_wn, stride_sn, B_FMT: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """bf16 ``[BLOCK_W, BLOCK_K]``: weight rows ``offs_w``, columns ``k0..`` (``k0`` a multiple of 32),
    scales applied; zero past row N or column K. ``EVEN_K``: K is a multiple of BLOCK_K, so no column
    mask, which would cut the loads into single bytes that the compiler cannot stream ahead."""
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
            scale_rows = offs_w // 32
            bias = 0
        else:
            cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            raw = tl.load(w_ptr + offs_w[:, None] * stride_wn + cols[None, :],
                          mask=row_mask if EVEN_K else row_mask & (cols[None, :] * 2 < K), other=0)
            low, high = e2m1_bytes_to_fp16(raw, INTERPRETED)
            values = tl.reshape(tl.join(low, high), (BLOCK_W, BLOCK_K)).to(tl.float32)  # low nibble first
            scale_rows = offs_w
            bias = 14  # the fp16 form is the e2m1 value times 2**-14
        blocks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exponents = tl.load(s_ptr + scale_rows[:, None] * stride_sn + blocks[None, :],
                            mask=row_mask if EVEN_K else row_mask & (blocks[None, :] * 32 < K), other=0).to(tl.int32)
        scale = ((exponents + bias) << 23).to(tl.float32, bitcast=True)  # UE8M0 byte e -> 2**(e - 127)
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
