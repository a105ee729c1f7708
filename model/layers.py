"""Small building blocks shared by the V4.1 modules: projections and RMSNorm."""

from __future__ import annotations

import torch

from .gemm import block_scaled_linear, dense_linear


class Linear:
    """A projection ``y = x @ W.T`` as the reference computes it for the weight's storage format.

    FP8/FP4 weights keep their unscaled values and per-row-per-32 scales for the block-scaled
    GEMM (which quantizes the activation first); bf16/fp32 weights are plain products.
    """

    def __init__(self, weight: torch.Tensor, batch_invariant: bool, scales: torch.Tensor | None = None):
        self.weight = weight  # [out, in]: bf16/fp32 values, or fp32 e4m3/e2m1 values when scales is set
        self.scales = scales  # [out, in / 32] fp32 powers of two, for quantized weights
        self.batch_invariant = batch_invariant

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def to(self, device) -> "Linear":
        self.weight = self.weight.to(device)
        if self.scales is not None:
            self.scales = self.scales.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is not None:
            return block_scaled_linear(x, self.weight, self.scales, self.batch_invariant)
        return dense_linear(x, self.weight, self.batch_invariant)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (the weight multiplies the fp32 value), returned in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)
