"""FP8 / FP4 quantization formats of DeepSeek-V4.1, bit-exact with the official kernels.

V4.1 rounds values through low-precision formats at fixed points of the network (quantize, then
dequantize back to bf16: "QDQ"):

* every activation entering an FP8/FP4 GEMM, and the sliding-window KV: FP8 e4m3, one power-of-two
  (UE8M0) scale per 32 values;
* index queries and index keys: FP4 e2m1, one UE8M0 scale per 32 values;
* compressed KV: FP4 e2m1, one E4M3 scale per 16 values (NVFP4 without the global scale).

The scale rounding reproduces the kernels' bit manipulation (``pow2_scale``), the casts are
round-to-nearest-even with saturation. Every QDQ result is exactly representable in bf16, which is
why caches can hold bf16 without losing anything.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# The kernels multiply by the reciprocal held as an fp32 constant, not divide by the max.
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)

# E2M1 magnitudes by 3-bit code; bit 3 of a 4-bit code is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_SIGNED = torch.cat([E2M1_VALUES, -E2M1_VALUES])
# Midpoints between neighbouring magnitudes. At an exact midpoint round-to-nearest-even picks the
# even code, which is the upper neighbour only for the midpoints 0.75, 1.75 and 3.5.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])
_DEVICE_COPIES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(device: torch.device, table: torch.Tensor) -> torch.Tensor:
    """``table`` (a constant above) on ``device``, copied once: a copy per call would make the host
    wait for the device, and a CUDA graph cannot capture it."""
    key = (id(table), device)
    if key not in _DEVICE_COPIES:
        _DEVICE_COPIES[key] = table.to(device)
    return _DEVICE_COPIES[key]


def pow2_scale(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(amax * max_inv)), read off the fp32 bits as the kernel does (UE8M0 scales)."""
    x = (amax.float() * _on(amax.device, max_inv)).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa_nonzero = (bits & 0x7FFFFF) != 0
    log2_ceil = exponent - 127 + mantissa_nonzero.to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448 (a bare cast makes NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> 4-bit E2M1 codes (uint8, bit 3 = sign), round-to-nearest-even."""
    mids = _on(x.device, _E2M1_MIDPOINTS)
    magnitude = x.abs().unsqueeze(-1)
    code = (magnitude > mids).sum(-1) + ((magnitude == mids) & _on(x.device, _E2M1_TIE_GOES_UP)).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> fp32 values (the sign of zero is kept: code 8 is -0.0)."""
    return _on(codes.device, E2M1_SIGNED)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] -> bytes [..., K/2]: element 2k in the low nibble, 2k+1 in the high one."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] (uint8 or int8 storage) -> codes [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------- FP8
def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [..., K] -> (e4m3 values [..., K], fp32 power-of-two scales [..., K/block])."""
    assert x.dtype == torch.bfloat16, "the FP8 activation kernel takes bf16 input"
    groups = x.float().unflatten(-1, (-1, block))
    scale = fp8_scale(groups.abs().amax(dim=-1))
    q = to_e4m3(groups / scale.unsqueeze(-1))
    return q.flatten(-2), scale


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of a group with largest magnitude ``amax`` (floored: zeros stay finite)."""
    return pow2_scale(amax.clamp_min(1e-4), _FP8_MAX_INV)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 quantize-dequantize of a bf16 tensor, back to bf16 (exact in bf16)."""
    q, scale = fp8_quantize(x, block)
    y = q.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)
    return y.flatten(-2).to(torch.bfloat16)


# ----------------------------------------------------------------------------------- FP4
def fp4_scale(amax: torch.Tensor, e4m3_scale: bool) -> torch.Tensor:
    """The scale of an FP4 group with largest magnitude ``amax``: E4M3 or a power of two."""
    if e4m3_scale:
        # compressed KV: a real E4M3 scale amax/6 (not a power of two); floor keeps zeros finite
        return to_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX).float()
    return pow2_scale(amax.clamp_min(6 * 2.0**-126), _FP4_MAX_INV)


def fp4_quantize(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [..., K] -> (packed e2m1 bytes [..., K/2] uint8, fp32 scales [..., K/block])."""
    assert x.dtype == torch.bfloat16, "the FP4 activation kernel takes bf16 input"
    groups = x.float().unflatten(-1, (-1, block))
    scale = fp4_scale(groups.abs().amax(dim=-1), e4m3_scale)
    v = (groups / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return pack_e2m1(e2m1_codes(v).flatten(-2)), scale


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    """FP4 quantize-dequantize of a bf16 tensor, back to bf16.

    ``block=32, e4m3_scale=False``: index queries/keys (UE8M0 scales).
    ``block=16, e4m3_scale=True``: compressed KV.
    """
    assert x.dtype == torch.bfloat16, "the FP4 activation kernel takes bf16 input"
    groups = x.float().unflatten(-1, (-1, block))
    scale = fp4_scale(groups.abs().amax(dim=-1), e4m3_scale)
    v = (groups / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    y = e2m1_values(e2m1_codes(v)) * scale.unsqueeze(-1)
    return y.flatten(-2).to(torch.bfloat16)


# ----------------------------------------------------------------------------------- weights
def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3 [N, K] with one power-of-two scale per block x block tile -> bf16 [N, K], exactly."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.float() * s).to(torch.bfloat16)


def fp8_weight_operands(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [N, K] + tile scales -> (fp32 values [N, K], fp32 scale of each row and K block [N, K/block])."""
    rows = scale.float().repeat_interleave(block, 0)[: weight.shape[0]]
    return weight.float(), rows.contiguous()


def fp4_weight_operands(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 [N, K/2] + per-row-per-32 scales -> (fp32 values [N, K], fp32 scales [N, K/32])."""
    return e2m1_values(unpack_e2m1(packed)), scale.float().contiguous()


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Packed e2m1 [N, K/2] with one power-of-two scale per row per 32 along K -> bf16 [N, K]."""
    values = e2m1_values(unpack_e2m1(packed))
    return (values * scale.float().repeat_interleave(block, 1)).to(torch.bfloat16)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3 table rows [R, K] with one scale per row per 32 values (Engram) -> bf16, exactly."""
    values = weight.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)
    return values.flatten(-2).to(torch.bfloat16)
