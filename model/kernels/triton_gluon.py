"""Gluon, Triton's dialect with explicit layouts, across the Triton versions the project runs on.

A Gluon kernel (``@gluon.jit``) says where each value lives: which thread holds which element of a
tensor, how a buffer in shared memory is laid out, when the tensor memory accelerator (TMA) copies a
tile and which barrier says it has landed. Plain Triton chooses those itself. Gluon ships with Triton
(``triton.experimental.gluon``) but is still experimental, and a few of its names changed between the
GPU machine's Triton 3.6 and the CPU suite's 3.9. The kernels import them from here:

- ``tma_load(descriptor, coordinates, barrier, destination)``: a TMA copy of one box of the
  descriptor's tensor into shared memory, counted on the mbarrier (3.6 ``async_copy_global_to_shared``,
  3.9 ``async_load``);
- ``cta_barrier()``: every thread of the program reaches it before any goes on (3.6 ``thread_barrier``,
  3.9 ``barrier``);
- ``reinterpret(buffer, dtype, shape, layout)``: the same bytes of shared memory seen with another type,
  shape and layout (3.6 the method ``_reinterpret``, 3.9 ``reinterpret``);
- ``GluonASTSource``: a Gluon kernel's source for ``triton.compile`` (the offline compile check).

Triton's interpreter runs no Gluon, so a Gluon kernel is checked by the GPU tests and by the CPU
suite's compile check for sm_90 (``tests/test_triton_compile.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def reinterpret(buffer, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    if hasattr(buffer, "reinterpret"):
        return buffer.reinterpret(dtype, shape, layout)
    else:
        return buffer._reinterpret(dtype, shape, layout)


try:
    from triton.experimental.gluon import GluonASTSource
except ImportError:  # Triton 3.6
    from triton.experimental.gluon._runtime import GluonASTSource

__all__ = ["GluonASTSource", "TensorDescriptor", "cta_barrier", "fence_async_shared", "gl", "gluon", "mbarrier",
           "reinterpret", "tma_load"]
