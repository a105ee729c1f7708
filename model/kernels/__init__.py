"""Kernel backends behind one small interface (see ``backend.py``)."""

from __future__ import annotations

from .backend import KernelBackend
from .weights import ExpertWeights, QuantizedWeight, stack_quantized

BACKENDS = ("reference", "triton")


def make_backend(name: str, batch_invariant: bool) -> KernelBackend:
    """The backend called ``name``; ``batch_invariant``: every row's result independent of the batch."""
    if name == "reference":
        from .reference import ReferenceKernels

        return ReferenceKernels(batch_invariant)
    if name == "triton":
        from .triton_backend import TritonKernels

        return TritonKernels(batch_invariant)
    raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(BACKENDS)}")


def default_backend_name(device: str) -> str:
    """``triton`` on CUDA, ``reference`` elsewhere."""
    return "triton" if str(device).startswith("cuda") else "reference"


__all__ = ["BACKENDS", "ExpertWeights", "KernelBackend", "QuantizedWeight", "default_backend_name", "make_backend",
           "stack_quantized"]
