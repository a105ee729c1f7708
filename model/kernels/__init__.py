"""Kernel backends behind one small interface (see ``backend.py``)."""

from __future__ import annotations

from .backend import KernelBackend
from .weights import ExpertWeights, QuantizedWeight, stack_quantized

BACKENDS = ("reference", "triton")


def make_backend(name: str, batch_invariant: bool, pdl: bool = False) -> KernelBackend:
    """The backend called ``name``; ``batch_invariant``: every row's result independent of the batch;
    ``pdl``: programmatic dependent launch of the Triton kernels that take it (``triton`` only)."""
    if pdl and name != "triton":
        raise ValueError(f"programmatic dependent launch needs the triton kernels, not {name!r}")
    if name == "reference":
        from .reference import ReferenceKernels

        return ReferenceKernels(batch_invariant)
    if name == "triton":
        from .triton_backend import TritonKernels

        return TritonKernels(batch_invariant, pdl)
    raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(BACKENDS)}")


def default_backend_name(device: str) -> str:
    """``triton`` on CUDA, ``reference`` elsewhere."""
    return "triton" if str(device).startswith("cuda") else "reference"


__all__ = ["BACKENDS", "ExpertWeights", "KernelBackend", "QuantizedWeight", "default_backend_name", "make_backend",
           "stack_quantized"]
