"""Triton kernel of a sub-layer's input (twins: ``triton_mhc.collapse``, then ``triton_rms_norm.rms_norm``).

Every sub-layer (attention, FFN) of a V4.1 block and the final norm start from mHC's stream: its copies
collapsed into one row by the mix ``pre``, then RMSNormed (and, for the FP8 linears, rounded through FP8:
FP8-ready rows, ``backend.py``). ``sublayer_input(stream, pre, weight, eps, outputs)`` does both in one
program per token, where they took two launches (17 a step of the 8-layer V4.1-Flash config fewer).

Each step's arithmetic is its kernel's, in the same order with fusion off: the collapse adds
``pre[k] * copy[k]`` from zero in increasing ``k`` and rounds to bf16; the norm is ``triton_rms_norm``'s
(``normed_row``, ``store_normed``). So the rows are the two launches' bits (tested), and each token is
computed alone: nothing depends on the batch. The whole row (V4.1-Flash: 4 copies of 5,120) is one
program's, 16 values per thread and copy.

(Tried and not kept: the FFN's input made in the launch of the attention's expand as well, which a
program per token then wrote and read back. On one H100 that launch took 9.8 / 11.0 / 15.9 µs at 1 / 16 /
64 tokens where the expand's own launch (five programs per token) and this one took 4.0 / 5.3 / 7.1:
one program walks the expand's copies alone; docs/benchmarks-log.md.)

Layouts: stream ``[T, hc, D]`` bf16 with ``D`` contiguous; pre ``[T, hc]`` fp32; outputs ``[T, D]`` bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_rms_norm import BOTH, PLAIN, check_outputs, normed_row, row_warps, store_normed


@triton.jit
def _sublayer_input_kernel(stream_ptr, pre_ptr, w_ptr, out_ptr, out2_ptr, D, inv_d, stride_st, stride_sh, stride_p,
                           stride_o, stride_o2, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr, OUTPUTS: tl.constexpr,
                           PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a model weight: before the wait
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    x = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(HC):  # triton_mhc.collapse
        copy = tl.load(stream_ptr + t * stride_st + k * stride_sh + cols, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(pre_ptr + t * stride_p + k) * copy
    x = to_bf16(x, INTERPRETED).to(tl.float32)
    store_normed(normed_row(x, weight, inv_d, eps, INTERPRETED), out_ptr + t * stride_o, out2_ptr + t * stride_o2,
                 cols, mask, BLOCK_D, True, OUTPUTS, INTERPRETED)


def sublayer_input(stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
                   outputs: int = PLAIN) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(collapse(stream, pre), weight, eps, outputs=outputs)`` in one launch: stream ``[T, hc, D]``
    bf16, pre ``[T, hc]`` -> ``[T, D]`` bf16 (``BOTH``: the pair of normed rows and their FP8 round trip);
    ``pdl``: programmatic dependent launch where the GPU has it (the norm's weight read before the wait)."""
    t, hc, d = stream.shape
    assert stream.dtype == torch.bfloat16 and stream.stride(-1) == 1, (stream.dtype, stream.stride())
    check_outputs(outputs, stream.dtype, d)
    out = torch.empty(t, d, dtype=torch.bfloat16, device=stream.device)
    out2 = torch.empty_like(out) if outputs == BOTH else out
    if t:
        pre = pre.float()
        block_d = triton.next_power_of_2(d)
        _sublayer_input_kernel[(t,)](
            stream, pre, weight, out, out2, d, 1.0 / d, stream.stride(0), stream.stride(1), pre.stride(0),
            out.stride(0), out2.stride(0), float(eps), HC=hc, BLOCK_D=block_d, OUTPUTS=outputs,
            INTERPRETED=INTERPRETED, num_warps=row_warps(block_d), enable_fp_fusion=False,
            **launch_arguments(pdl, stream.device))
    return (out, out2) if outputs == BOTH else out
