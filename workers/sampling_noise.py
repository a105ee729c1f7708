"""Counter-based sampling noise: a pure integer hash of (seed, position, token_id).

Why a hash and not torch's RNG: DESIGN.md requires that the noise of a sequence be a
function of (seq_seed, position) only, so a preempted-and-recomputed sequence samples the
same tokens whatever batch it lands in, and CPU and CUDA agree. A stateful generator
cannot give that (its stream depends on how many draws came before and on the device's
generator algorithm); a stateless hash of the coordinates can.

All arithmetic is done on int64 tensors whose values are kept in [0, 2**32) ("32-bit
lanes"). Multiplications are split into 16-bit halves so no intermediate ever exceeds
2**48: nothing overflows, no signed-overflow behaviour is relied upon, and right shifts
only ever see non-negative values (so arithmetic vs logical shift does not matter). The
result is therefore bitwise identical on every device and batch layout.
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

# Multipliers of a well-tested 32-bit xorshift-multiply finalizer (low avalanche bias).
_MIX_MUL_1 = 0x21F0AAAD
_MIX_MUL_2 = 0x735A2D97
# Odd constants (golden-ratio and a murmur-style prime) that separate the three inputs,
# so that e.g. seed word 5 and token id 5 do not feed the mixer the same value.
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x85EBCA6B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), c a constant < 2**32, without overflow.

    x = hi * 2**16 + lo, so x*c = lo*c + (hi*c) * 2**16; only the low 16 bits of hi*c
    survive the shift modulo 2**32. lo*c and hi*c are both < 2**48.
    """
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (xorshift / multiply rounds) on int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL_2)
    x = x ^ (x >> 15)
    return x


def mix32_int(x: int) -> int:
    """Plain-Python twin of mix32 (arbitrary precision ints, masked): the test oracle."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MIX_MUL_1) & MASK32
    x ^= x >> 15
    x = (x * _MIX_MUL_2) & MASK32
    x ^= x >> 15
    return x


def split_seed(seed: int) -> tuple[int, int]:
    """Any Python int seed -> its low and high 32-bit words (seed taken modulo 2**64)."""
    s = seed & MASK64
    return s & MASK32, s >> 32


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its seed words and absolute position ([R] int64 each: tensors, or
    numpy arrays, on which the same operators give the same values).

    For a fixed seed the map position -> key is a bijection (a chain of bijections), so
    two positions of one sequence never share a noise vector.
    """
    k = mix32(seed_lo ^ _SEED_SALT)
    k = mix32(k ^ seed_hi)
    return mix32(k ^ positions)


def row_key_int(seed: int, position: int) -> int:
    """Plain-Python twin of row_keys for one row."""
    lo, hi = split_seed(seed)
    k = mix32_int(lo ^ _SEED_SALT)
    k = mix32_int(k ^ hi)
    return mix32_int(k ^ position)


@functools.lru_cache(maxsize=8)
def token_mix(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-token pre-mixed ids [V] (int64), cached per vocab size and device."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32(ids ^ _TOKEN_SALT)


def hash_bits(keys: torch.Tensor, mixed_tokens: torch.Tensor) -> torch.Tensor:
    """32 random bits per (row, token): [R] keys x [V] mixed ids -> [R, V] int64."""
    return mix32(keys[:, None] ^ mixed_tokens[None, :])


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit ints -> float64 uniforms (bits + 0.5) / 2**32, strictly inside (0, 1).

    float64 holds every such value exactly (33 significant bits), so there is no rounding
    to 0 or 1 and the Gumbel tail is resolved down to probabilities of ~2**-33.
    """
    return (bits.to(torch.float64) + 0.5) * (2.0**-32)


def gumbel_noise(keys: torch.Tensor, mixed_tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise g = -log(-log(u)) for each (row, token), float64 [R, V]."""
    u = bits_to_uniform(hash_bits(keys, mixed_tokens))
    return -torch.log(-torch.log(u))
