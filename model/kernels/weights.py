"""Quantized weights as the checkpoint stores them, and the routed experts of one MoE layer.

Nothing here is ever dequantized ahead of time: a ``QuantizedWeight`` holds the checkpoint's own
bytes (e4m3 values with UE8M0 32x32 tile scales, or packed e2m1 with UE8M0 scales per row per 32
along K), and every kernel backend expands only what one call needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import WeightFormat
from ..quant import e2m1_values, unpack_e2m1
from .fp4_fragments import scales_from_fragments, to_fragments, values_from_fragments

SCALE_BLOCK = 32  # the K block of every scale (and the row block of FP8 tile scales)


@dataclass
class QuantizedWeight:
    """A projection ``[N, K]`` (or a stack ``[E, N, K]`` of them) in its storage format.

    FP8: ``values`` float8_e4m3fn ``[.., N, K]``, ``scales`` float8_e8m0fnu ``[.., ceil(N/32), K/32]``
    (one power of two per 32x32 tile). FP4: ``values`` int8 ``[.., N, K/2]`` (element 2k in the low
    nibble), ``scales`` float8_e8m0fnu ``[.., N, K/32]``. ``fragments``: FP4 bytes permuted into the
    experts' kernel layout (``fp4_fragments.py``; same shapes and bytes, another order).
    """

    values: torch.Tensor
    scales: torch.Tensor
    fmt: WeightFormat
    fragments: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in (WeightFormat.FP8, WeightFormat.FP4):
            raise ValueError(f"a QuantizedWeight is FP8 or FP4, not {self.fmt}")
        if self.fragments and self.fmt is not WeightFormat.FP4:
            raise ValueError("only FP4 weights have a fragment layout")

    @property
    def out_features(self) -> int:
        return self.values.shape[-2]

    @property
    def in_features(self) -> int:
        k = self.values.shape[-1]
        return k * 2 if self.fmt is WeightFormat.FP4 else k

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def to(self, device) -> "QuantizedWeight":
        self.values, self.scales = self.values.to(device), self.scales.to(device)
        return self

    def __getitem__(self, index) -> "QuantizedWeight":
        """One matrix of a stack (a view: no copy)."""
        return QuantizedWeight(self.values[index], self.scales[index], self.fmt, self.fragments)

    def to_fragments(self) -> "QuantizedWeight":
        """Permute FP4 values and scales into the fragment layout in place, one matrix at a time (a
        stack never needs twice its memory)."""
        if self.fragments:
            return self
        matrices = [self] if self.values.dim() == 2 else [self[i] for i in range(self.values.shape[0])]
        for matrix in matrices:  # views into the stack
            values, scales = to_fragments(matrix.values, matrix.scales)
            matrix.values.copy_(values)
            matrix.scales.copy_(scales)
        self.fragments = True
        return self

    # ---------------------------------------------------------------- exact expansions (fp32)
    def unscaled_values(self) -> torch.Tensor:
        """fp32 ``[.., N, K]``: the e4m3 / e2m1 values without their scales (exact)."""
        if self.fmt is WeightFormat.FP8:
            return self.values.float()
        return e2m1_values(unpack_e2m1(values_from_fragments(self.values) if self.fragments else self.values))

    def row_scales(self) -> torch.Tensor:
        """fp32 ``[.., N, K/32]``: the scale of every row and K block (FP8 tile scales repeated)."""
        scales = (scales_from_fragments(self.scales) if self.fragments else self.scales).float()
        if self.fmt is WeightFormat.FP8:
            scales = scales.repeat_interleave(SCALE_BLOCK, dim=-2)[..., : self.out_features, :]
        return scales.contiguous()

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[.., N, K]`` values times scales, exact in bf16 (e4m3/e2m1 times a power of two)."""
        values = self.unscaled_values().unflatten(-1, (-1, SCALE_BLOCK))
        return (values * self.row_scales().unsqueeze(-1)).flatten(-2).to(dtype)


@dataclass
class ExpertWeights:
    """The routed experts one rank holds, stacked: ``w1``/``w3`` ``[E, inter, D]``, ``w2`` ``[E, D, inter]``.

    Stacking is a re-layout of the checkpoint's per-expert tensors (same bytes), so that one
    kernel launch can reach every expert. ``first_expert`` is the global id of stack entry 0.
    Unquantized (bf16) experts are held as plain tensors in the same shapes.
    """

    w1: QuantizedWeight | torch.Tensor  # gate projection
    w3: QuantizedWeight | torch.Tensor  # up projection
    w2: QuantizedWeight | torch.Tensor  # down projection
    first_expert: int
    swiglu_limit: float

    @property
    def num_experts(self) -> int:
        w = self.w1.values if isinstance(self.w1, QuantizedWeight) else self.w1
        return w.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.w1, self.w2, self.w3))

    def to(self, device) -> "ExpertWeights":
        self.w1, self.w2, self.w3 = (w.to(device) for w in (self.w1, self.w2, self.w3))
        return self


def stack_quantized(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack per-expert weights of one format and layout into ``[E, ...]`` (a copy of the same bytes)."""
    return QuantizedWeight(torch.stack([w.values for w in weights]), torch.stack([w.scales for w in weights]),
                           weights[0].fmt, weights[0].fragments)
