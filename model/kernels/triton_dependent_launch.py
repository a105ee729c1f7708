"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream finishes.

Without it, a kernel's programs start only once every program of the previous kernel has exited and
its writes are flushed: inside a CUDA graph each boundary costs a few microseconds in which the GPU
streams no weight, and a decode step of small products has dozens of boundaries per layer. With it
(Hopper and later), a kernel launched with ``launch_pdl=True`` may start as soon as every program of
the kernel before it has called ``griddepcontrol.launch_dependents`` (``let_next_kernel_start``) or
exited; its programs then do what needs nothing from earlier kernels and block in
``griddepcontrol.wait`` (``wait_for_previous_kernel``) until the previous kernel has completed and
its writes are visible.

The rule every kernel launched this way keeps: **before its wait it writes nothing and reads nothing
that the kernel right before it writes**. What it may read there: the weights and their scales, which
no kernel of the step writes, and what kernels before the previous one wrote. Each kernel calls
``let_next_kernel_start`` only after its own wait returned, so when a kernel starts, the one before it
has passed its wait: every kernel before that one has completed and its writes are visible. The
routed experts of a one-token step use this: their kernels read the routing's expert ids (written
before the activation's quantization, the kernel right before gate/up) and load their first weights
before the wait. The inputs that the previous kernel writes, the scratch, the outputs and the split
counters (``triton_split_sums``) are touched after the wait, so the previous kernel has finished with
all of them, whatever buffer the allocator handed out twice. The guarantee chains: a kernel
completes only after its own wait returned, so waiting for the previous kernel also waits for every
kernel before it, PDL-launched or not. At most two kernels' programs are resident at a time, the
second's blocked in its wait or streaming its first weights.

A kernel launched without the attribute (a torch kernel, say) after one that let the next start
simply waits for it to complete, as always; the instructions are no-ops when the kernel was not
launched with the attribute, so the same compiled kernel is correct either way.

Used by the decode-sized products, which load their first weights before the wait (``triton_gemv``
when its weight goes through registers; through its ring in shared memory, the default, it fetches
the ring's first steps into L2 before the wait instead, ``fetch_into_l2``, since the ring's copies are
the compiler's pipeline, which starts after the wait, and it lets the next kernel start only once its
weight is streamed; so does the decode form of 3-256 tokens, ``triton_decode_mm``, whose split sums
wait first), by the routed experts' chain on the tensor cores
(``triton_mma_experts``: the activation's quantization, the pairs' sort, gate/up and down; which weights
they read depends on the routing, so after a sort they only overlap their launches, and without one
they load their first weights early as above) and by the small kernels a decode step runs right before
products (``triton_rms_norm``, which loads its norm weight first, and the SwiGLU of
``triton_moe_sum``), so that those products start early too. Off unless asked for (``--enable-pdl``):
on one H100 a layer's nine FP8 projections in one CUDA graph took 88.2 / 113.9 / 123.8 / 143.4 µs at
1 / 2 / 4 / 8 tokens with it against 86.8 / 116.8 / 119.0 / 139.4 without, and a one-token step's
experts 51.4 against 53.6 µs (without the sort; 60.2 against 59.3 with it; docs/benchmarks-log.md). With
the ring the one-token layer took 80.7 against 78.5 µs while it waited first and let the next kernel
start at once; fetching the ring's first steps into L2 and letting the next start once the weight is
streamed made it 76.4 against 78.5 (one H100; more steps fetched, or the next kernel let in at once,
were slower: 82.6-112.2 µs). The engine's decode steps of the 8-layer V4.1-Flash config took 2.48 / 7.52
ms at batch 1 / 16 with it and 2.49 / 7.48 without (one H100, fdb092f). The interpreter has no such
instructions, so interpreted kernels never use it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .triton_common import INTERPRETED

MIN_CAPABILITY = 9  # griddepcontrol: sm_90 and later


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible (a no-op
    without ``PDL``). Nothing before this call may read what a kernel of the step writes, nor write."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """Let the next kernel in the stream start its programs (they wait for this kernel's completion
    before touching its outputs); called right after ``wait_for_previous_kernel``."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def fetch_into_l2(ptrs, PDL: tl.constexpr):
    """Ask for the 128-byte lines at ``ptrs`` to be brought into L2 (``prefetch.global.L2``: no register
    holds them, nothing waits for them); a no-op without ``PDL``. A kernel's first weights, fetched
    before its wait, stream from memory while the previous kernel finishes."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def compute_capability(device_index: int) -> int:
    """The major compute capability of a CUDA device (9: Hopper), asked once per device."""
    return torch.cuda.get_device_capability(device_index)[0]


def dependent_launch(requested: bool, device: torch.device) -> bool:
    """Whether a kernel for ``device`` is launched with PDL: asked for, compiled (not interpreted) and
    a GPU that has it."""
    return (requested and not INTERPRETED and device.type == "cuda"
            and compute_capability(device.index or 0) >= MIN_CAPABILITY)


def launch_arguments(requested: bool, device: torch.device) -> dict[str, bool]:
    """The launch's ``PDL`` (the kernel's constexpr: wait, then let the next start) and ``launch_pdl`` (the
    attribute that lets the kernel start early), always equal: a kernel started early that did not
    wait would read its inputs before they are written."""
    on = dependent_launch(requested, device)
    return {"PDL": on, "launch_pdl": on}
