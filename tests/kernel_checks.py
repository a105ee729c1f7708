"""Checks shared by the kernel tests: where a kernel runs, and the one-bf16-ulp agreement check.

A kernel whose output is one short fp32 expression of its inputs, rounded once to bf16, differs
from its twin only when the two fp32 values (other sum orders, another ``exp``) fall on two sides
of a bf16 rounding boundary: then by one bf16 ulp, at most 2**-7 of the value, and rarely.
"""

from __future__ import annotations

import torch


def device() -> str:
    """Where a kernel under test runs: the GPU when there is one, else Triton's interpreter on the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def one_bf16_ulp_mismatch(got: torch.Tensor, ref: torch.Tensor, min_bit_equal: float) -> str | None:
    """Why ``got`` is not within one bf16 ulp of ``ref`` everywhere with at least ``min_bit_equal`` of
    the elements bit-equal; None if it is."""
    got, ref = got.float(), ref.float()
    worst = ((got - ref).abs() / (ref.abs() * 2.0 ** -7 + 1e-30)).max().item()
    if worst > 1.0:
        return f"{worst:.3g} bf16 ulps apart"
    equal = (got == ref).float().mean().item()
    return None if equal >= min_bit_equal else f"only {equal:.2%} bit-equal"


def coefficients_too_far(got, ref, relative: float) -> str | None:
    """Why mHC's coefficients ``got`` (pre, post, comb) are not within ``relative`` of ``ref`` element
    by element; None if they are."""
    for name, g, r in zip(("pre", "post", "comb"), got, ref):
        assert g.shape == r.shape and g.dtype == torch.float32
        worst = ((g - r).abs() / (r.abs() * relative)).max().item()
        if worst > 1.0:
            return f"{name}: {worst:.3g} times the tolerance"
    return None
