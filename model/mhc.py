"""Manifold-constrained hyper-connections (mHC): the residual stream as ``hc_mult`` parallel copies.

Around every sub-layer (attention, MoE) the block derives three coefficient sets from the stream
itself: ``pre`` collapses the copies into the sub-layer input, ``post`` spreads the sub-layer output
back over the copies, and ``comb`` (made doubly stochastic by Sinkhorn iterations) mixes the
residual copies. V4.1 delays ``pre`` by one sub-layer: the coefficients a sub-layer computes are
used to collapse the stream for the *next* sub-layer (layer 0's attention uses a one-hot mix).
All coefficient arithmetic is fp32, in the official kernel's operation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .gemm import dense_linear

if TYPE_CHECKING:
    from .kernels import KernelBackend


def mixes(stream: torch.Tensor, fn: torch.Tensor, norm_eps: float, batch_invariant: bool) -> torch.Tensor:
    """stream [T, hc, D] -> raw mixes [T, (2+hc)*hc]; normalised after the projection, per token."""
    x = stream.flatten(-2).float()
    rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return dense_linear(x, fn, batch_invariant) * rsqrt


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                   iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[j, k]: copy j -> k)."""
    m = mixes.float()
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))  # softmax over k ...
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps  # ... plus eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # the column normalisation comes first
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperConnection:
    """The coefficient projection of one sub-layer (``hc_attn_*`` or ``hc_ffn_*`` tensors)."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 sinkhorn_iters: int, hc_eps: float, norm_eps: float, kernels: "KernelBackend"):
        self.fn, self.base, self.scale = fn, base, scale
        self.kernels = kernels
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps

    def to(self, device) -> "HyperConnection":
        self.fn, self.base, self.scale = self.fn.to(device), self.base.to(device), self.scale.to(device)
        return self

    def mixes(self, stream: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """The reference's raw mixes (``parity`` compares them with the golden set's)."""
        return mixes(stream, self.fn, self.norm_eps, batch_invariant)

    def coefficients(self, stream: torch.Tensor):
        """pre, post, comb of ``stream [T, hc, D]`` (the kernel backend's ``hc_coefficients``)."""
        return self.kernels.hc_coefficients(stream, self.fn, self.scale, self.base, self.hc, self.iters,
                                            self.hc_eps, self.norm_eps)


def collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, hc, D] x [T, hc] -> [T, D]: weighted sum of the copies in fp32, back to the stream dtype."""
    return torch.sum(pre.unsqueeze(-1) * stream.float(), dim=1).to(stream.dtype)


def expand(output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Spread a sub-layer output over the copies and mix the residual in through ``comb``.

    output [T, D], residual [T, hc, D], post [T, hc], comb [T, hc, hc] -> [T, hc, D]
    """
    y = post.unsqueeze(-1) * output.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=1)
    return y.to(output.dtype)


def identity_pre_mix(num_tokens: int, hc: int, device) -> torch.Tensor:
    """Layer 0's attention collapses with a one-hot mix: the first copy."""
    pre = torch.zeros(num_tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre
