"""Small building blocks shared by the V4.1 modules: projections and RMSNorm."""

from __future__ import annotations

import torch

from .gemm import dense_linear
from .kernels import KernelBackend, QuantizedWeight


class Linear:
    """A projection ``y = x @ W.T`` as the reference computes it for the weight's storage format.

    FP8/FP4 weights stay quantized and run the kernel backend's block-scaled GEMM (which quantizes
    the activation first); bf16/fp32 weights are plain products.
    """

    def __init__(self, weight: torch.Tensor | QuantizedWeight, kernels: KernelBackend, batch_invariant: bool):
        self.weight = weight
        self.kernels = kernels
        self.batch_invariant = batch_invariant

    @property
    def out_features(self) -> int:
        return self.weight.out_features if isinstance(self.weight, QuantizedWeight) else self.weight.shape[0]

    def to(self, device) -> "Linear":
        self.weight = self.weight.to(device)
        return self

    @property
    def quantized(self) -> bool:
        """Whether the weight is FP8/FP4, so that the product rounds its activation through FP8 first."""
        return isinstance(self.weight, QuantizedWeight)

    def __call__(self, x: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        """``prepared``: ``x`` came from a kernel asked for FP8-ready rows (``fp8_ready=True``,
        ``model/kernels/backend.py``); only a quantized linear's input may be."""
        if isinstance(self.weight, QuantizedWeight):
            return self.kernels.quantized_linear(x, self.weight, prepared)
        if prepared:
            raise ValueError("FP8-ready rows go to quantized linears only")
        return dense_linear(x, self.weight, self.batch_invariant)


def quantized(*linears: Linear) -> bool:
    """Whether every one of ``linears`` is quantized: whether their input may be FP8-ready rows."""
    return all(lin.quantized for lin in linears)


def project(x: torch.Tensor, *linears: Linear, prepared: bool = False) -> list[torch.Tensor]:
    """``[lin(x, prepared) for lin in linears]``: projections of one input, which the backend may run
    together (one launch for a token's two FP8 projections) when every weight is quantized."""
    weights = [lin.weight for lin in linears]
    if quantized(*linears):
        return linears[0].kernels.quantized_linears(x, weights, prepared)
    return [lin(x, prepared) for lin in linears]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (the weight multiplies the fp32 value), returned in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)
