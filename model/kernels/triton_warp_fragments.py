"""Tensor-core fragments held one element per thread: the kernels that feed ``mma.sync`` from registers.

Which thread holds which element of a Triton tensor is the compiler's choice (its layout), but a
tensor-core instruction needs each lane's own fragment. So ``triton_mma_experts``'s kernels read each
thread's lane and warp from the hardware (``warp_lanes``) into tensors of one element per thread,
compute every address from them, and load, multiply and store element by element: each thread
multiplies what it loaded itself, whatever the layout. The one thing the layout must give is one element
per thread (the warp-wide instruction needs all 32 lanes), which ``tests/test_triton_compile.py`` checks
in the compiled kernels.

Triton's interpreter runs no inline assembly: there, element i of a lane tensor plays thread i, and
``emulated_mma_bf16`` computes the tensor-core product over the same per-lane fragments with tensor
operations (the fragment layout of the PTX ISA's m16n8k16: lane ``4 g + t`` holds rows g and g + 8 of
A at K slots 2t, 2t+1, 2t+8, 2t+9, column g of B at the same slots, and D's rows g, g + 8 at columns
2t, 2t+1).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def warp_lanes(THREADS: tl.constexpr, INTERPRETED: tl.constexpr):
    """(lane, warp) of the thread holding each element of a ``[THREADS]`` tensor (one per thread)."""
    index = tl.arange(0, THREADS)
    if INTERPRETED:  # the interpreter's element i plays thread i
        return index % 32, index // 32
    else:
        return tl.inline_asm_elementwise(
            asm="mov.u32 $0, %laneid; mov.u32 $1, %tid.x; shr.u32 $1, $1, 5;",
            constraints="=r,=r,r", args=[index], dtype=(tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _bf16x2_values(register):
    """int32 holding two bf16 (the low half first) -> fp32 ``[.., 2]`` (exact)."""
    low = (register << 16).to(tl.float32, bitcast=True)
    high = (register & -65536).to(tl.float32, bitcast=True)
    return tl.join(low, high)


@triton.jit
def emulated_mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, THREADS: tl.constexpr):
    """The interpreter's ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: each lane's A
    registers ``a0..a3`` and B registers ``b0, b1`` (bf16 pairs in int32), its running sums ``c0..c3``
    -> its ``d0..d3`` (fp32 sums of exact products; the order of the sums is the interpreter's). The
    registers may carry a trailing axis of S consecutive products (``[THREADS, S]``; the sums
    ``[THREADS]``), which are added together."""
    WARPS: tl.constexpr = THREADS // 32
    SLOTS: tl.constexpr = a0.numel // THREADS * 4
    # lane (g, t)'s K slots 2t, 2t+1, 2t+8, 2t+9 (of each product) of A's rows g and g + 8 and of B's
    # column g, in the same order for all three
    row_g = tl.reshape(tl.join(_bf16x2_values(a0), _bf16x2_values(a2)), (WARPS, 8, 4, SLOTS))
    row_g8 = tl.reshape(tl.join(_bf16x2_values(a1), _bf16x2_values(a3)), (WARPS, 8, 4, SLOTS))
    column = tl.reshape(tl.join(_bf16x2_values(b0), _bf16x2_values(b1)), (WARPS, 8, 4, SLOTS))
    # D[row, n] sums the slots of the 4 lanes t: [warp, row, n]; lane (g, t) keeps n = 2t, 2t + 1
    d_g = tl.sum(tl.sum(row_g[:, :, None] * column[:, None], axis=4), axis=3)
    d_g8 = tl.sum(tl.sum(row_g8[:, :, None] * column[:, None], axis=4), axis=3)
    d0, d1 = tl.split(tl.reshape(d_g, (THREADS, 2)))
    d2, d3 = tl.split(tl.reshape(d_g8, (THREADS, 2)))
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3
