"""The FP4 experts' kernel layout: each GPU thread's tensor-core fragment in one 32-bit word.

The checkpoint stores an FP4 matrix ``[N, K]`` as packed e2m1 codes row by row (element 2k in the
low nibble) with one UE8M0 scale per row and 32 columns. Expanding that layout on Hopper costs
~7 instructions per value (byte gathers, fp16 -> fp32 -> bf16 conversions, an fp32 scale multiply):
more than the SMs can issue at the memory bandwidth, so the experts' kernels were bound by
instruction issue, not by HBM. The fragment layout holds the same bytes, permuted once at load
(``to_fragments``; ``from_fragments`` undoes it), so that the kernel expands a value in ~2
instructions:

* **Words.** A 16 x 16 tile of the matrix (rows ``16 rg ..``, columns ``16 c ..``) is read by a
  tensor-core instruction as 32 fragments of 8 values: thread ``(g, t)`` (g < 8, t < 4) holds rows
  ``g`` and ``g + 8`` at columns ``2t, 2t + 1`` and ``2t + 8, 2t + 9``. Each fragment is one 32-bit
  word, stored in the order ``[N/16, K/64, g, t, c % 4, 4 bytes]``: a thread's words for 64
  consecutive columns are 16 contiguous bytes (one vector load), and a warp's are 512.
* **Bits.** The word's 8 codes are placed so that each pair of them becomes a pair of bf16
  values (one 32-bit register, the tensor-core operand) by one shift and one mask:
  bf16 bits ``s0000000 emm00000`` hold ``e2m1 x 2**-126`` for code (s, e, m) = (s, 2 bits, 1 bit),
  subnormal 0.5 included. Pairs 0-2 sit at shifts 0, 3 and 6 of the mask ``0x81C081C0``; the
  fourth pair takes the 4 bits left in each half (sign at 14, exponent at 11..10, mantissa at 13).
  Register ``p`` of a word holds: p = 0: row g, columns 2t, 2t+1; p = 1: row g+8, same columns;
  p = 2: row g, columns 2t+8, 2t+9; p = 3: row g+8, those columns.
* **Scales.** One bf16 multiply by ``2**(e - 1)`` turns ``e2m1 x 2**-126`` into ``e2m1 x 2**(e-127)``,
  exactly when the result is a normal bf16 and the factor does not overflow: UE8M0 exponents
  ``2 <= e <= 128`` (scales 2**-125 .. 2; real FP4 weights sit near 2**-8). ``fragments_exact``
  checks that once at load; a matrix outside it keeps the row layout and the row kernel. The
  scales are stored ``[N/16, K/32, g, h]`` (row 16 rg + 8 h + g): the two a fragment needs are
  one 16-bit load.

Shapes: N a multiple of 16 and K of ``FRAGMENT_COLS`` (every real V4.1 expert). The permutation is
per matrix, so stacked experts stay ``[E, ...]`` slabs that expert moves copy as bytes.
"""

from __future__ import annotations

import torch

from ..quant import pack_e2m1, unpack_e2m1

FRAGMENT_ROWS = 16
FRAGMENT_COLS = 64  # columns per group of a thread's 4 words (one 16-byte load)
MIN_EXPONENT, MAX_EXPONENT = 2, 128  # UE8M0 scale bytes the bf16 multiply handles exactly

# (shift of the sign bit, shift of the 3 magnitude bits) in a 16-bit half, for pairs 0..2; pair 3 is
# split: sign at 14, exponent bits at 11..10, mantissa bit at 13
_PAIR_SIGN = (15, 12, 9)
_PAIR_MAGNITUDE = (6, 3, 0)


def fragments_fit(n: int, k: int) -> bool:
    return n % FRAGMENT_ROWS == 0 and k % FRAGMENT_COLS == 0


def fragments_exact(scales: torch.Tensor) -> bool:
    """Whether every UE8M0 scale byte lets the kernel's bf16 multiply be exact (one device sync)."""
    e = scales.view(torch.uint8)
    return bool(((e >= MIN_EXPONENT) & (e <= MAX_EXPONENT)).all())


def _code_bits(codes: torch.Tensor, pair: int, half: int) -> torch.Tensor:
    """int32 bits of e2m1 ``codes`` placed as register ``pair``'s 16-bit ``half`` expects them."""
    c = codes.to(torch.int32)
    sign, magnitude = c >> 3, c & 7
    base = 16 * half
    if pair < 3:
        return (sign << (_PAIR_SIGN[pair] + base)) | (magnitude << (_PAIR_MAGNITUDE[pair] + base))
    return (sign << (14 + base)) | ((magnitude >> 1) << (10 + base)) | ((magnitude & 1) << (13 + base))


def _bits_code(word: torch.Tensor, pair: int, half: int) -> torch.Tensor:
    base = 16 * half
    if pair < 3:
        sign = (word >> (_PAIR_SIGN[pair] + base)) & 1
        magnitude = (word >> (_PAIR_MAGNITUDE[pair] + base)) & 7
    else:
        sign = (word >> (14 + base)) & 1
        magnitude = (((word >> (10 + base)) & 3) << 1) | ((word >> (13 + base)) & 1)
    return ((sign << 3) | magnitude).to(torch.uint8)


def _fragment_view(x: torch.Tensor) -> torch.Tensor:
    """``[.., N, K]`` -> ``[.., N/16, K/64, g, t, c, h, b, j]`` (row 16 rg + 8 h + g, column
    64 kq + 16 c + 8 j + 2 t + b)."""
    *lead, n, k = x.shape
    x = x.reshape(*lead, n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # rg h g kq c j t b
    d = len(lead)
    return x.permute(*range(d), d, d + 3, d + 2, d + 6, d + 4, d + 1, d + 7, d + 5)


def _row_view(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``_fragment_view``."""
    d = x.dim() - 8
    x = x.permute(*range(d), d, d + 5, d + 2, d + 1, d + 4, d + 7, d + 3, d + 6)  # rg h g kq c j t b
    return x.reshape(*x.shape[:d], n, k)


def to_fragments(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint FP4 ``values [.., N, K/2]`` and ``scales [.., N, K/32]`` -> the same bytes in the
    fragment layout, same shapes and dtypes."""
    *lead, n, half_k = values.shape
    k = 2 * half_k
    if not fragments_fit(n, k):
        raise ValueError(f"the fragment layout needs N % 16 == 0 and K % 64 == 0, not [{n}, {k}]")
    codes = _fragment_view(unpack_e2m1(values))  # [.., rg, kq, g, t, c, h, b, j]
    word = torch.zeros(codes.shape[:-3], dtype=torch.int32, device=values.device)
    for h in range(2):
        for j in range(2):
            for b in range(2):
                word |= _code_bits(codes[..., h, b, j], pair=2 * j + h, half=b)
    packed = word.contiguous().view(torch.uint8).reshape(*lead, n, half_k).view(values.dtype)
    return packed, _scales_to_fragments(scales)


def from_fragments(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``to_fragments``: the checkpoint's own bytes."""
    return values_from_fragments(values), scales_from_fragments(scales)


def values_from_fragments(values: torch.Tensor) -> torch.Tensor:
    """The checkpoint's packed e2m1 rows ``[.., N, K/2]`` of values in the fragment layout."""
    *lead, n, half_k = values.shape
    k = 2 * half_k
    words = values.contiguous().view(torch.uint8).reshape(*lead, n // 16, k // 64, 8, 4, 4, 4).view(torch.int32)
    words = words.squeeze(-1)  # [.., rg, kq, g, t, c]
    codes = torch.stack([torch.stack([torch.stack([_bits_code(words, 2 * j + h, b) for j in range(2)], -1)
                                      for b in range(2)], -2) for h in range(2)], -3)  # [.., h, b, j]
    return pack_e2m1(_row_view(codes, n, k)).view(values.dtype)


def fragment_column_order(k: int) -> torch.Tensor:
    """``order[col]``: where an activation row's column ``col`` goes in the fragment layout's column
    order (``triton_weight_tiles.fragment_column``): column ``64 q + 16 c + 8 j + 2 t + b`` to
    ``64 q + 16 t + 4 c + 2 j + b``, lane t's B fragments of the four 16-column steps side by side."""
    col = torch.arange(k)
    c, j, t, b = (col >> 4) & 3, (col >> 3) & 1, (col >> 1) & 3, col & 1
    return (col & -64) | (t << 4) | (c << 2) | (j << 1) | b


def _scales_to_fragments(scales: torch.Tensor) -> torch.Tensor:
    *lead, n, blocks = scales.shape
    d = len(lead)
    s = scales.view(torch.uint8).reshape(*lead, n // 16, 2, 8, blocks)  # rg h g block
    s = s.permute(*range(d), d, d + 3, d + 2, d + 1)  # rg block g h
    return s.contiguous().reshape(*lead, n, blocks).view(scales.dtype)


def scales_from_fragments(scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's scales ``[.., N, K/32]`` of scales in the fragment layout."""
    *lead, n, blocks = scales.shape
    d = len(lead)
    s = scales.view(torch.uint8).reshape(*lead, n // 16, blocks, 8, 2)  # rg block g h
    s = s.permute(*range(d), d, d + 3, d + 2, d + 1)  # rg h g block
    return s.contiguous().reshape(*lead, n, blocks).view(scales.dtype)
