"""Triton kernel of a sub-layer's input (twins: ``triton_mhc.expand``, ``triton_mhc.collapse`` and
``triton_rms_norm.rms_norm``, in that order).

Every sub-layer (attention, FFN) of a V4.1 block starts from mHC's stream: the copies collapsed into one row
by the mix ``pre``, then RMSNormed (and, for the FP8 linears, rounded through FP8: FP8-ready rows,
``backend.py``). The FFN's stream is the attention's output expanded into the stream, which its collapse
reads right back. One program per token does the chain:

* ``sublayer_input(stream, pre, weight, eps, outputs)``: the collapse, then the norm (two launches before);
* ``expand_and_sublayer_input(output, residual, post, comb, pre, weight, eps, outputs)``: first the expand
  of the previous sub-layer's ``output`` with the ``residual`` stream (``post``, ``comb``), whose new stream
  it writes and collapses from registers (three launches before).

Each step's arithmetic is its kernel's, in the same order with fusion off: the expand's copy ``k`` is
``post[k] * output + (sum over j of comb[j, k] * residual[j], from zero in increasing j)``, rounded to
bf16 and stored; the collapse reads the stream back (after a barrier: other threads stored it), adds
``pre[k] * copy[k]`` from zero in increasing ``k`` and rounds to bf16; the norm is ``triton_rms_norm``'s
(``normed_row``, ``store_normed``). So the rows are the separate launches' bits (tested), and each token is
computed alone: nothing depends on the batch. The whole row (V4.1-Flash: 4 copies of 5,120) is one
program's, 16 values per thread and copy (the expand ``EXPAND_CHUNK`` columns at a time).

Layouts: stream and residual ``[T, hc, D]`` bf16 with ``D`` contiguous; output ``[T, D]`` bf16; pre, post
``[T, hc]`` and comb ``[T, hc, hc]`` fp32; outputs ``[T, D]`` bf16 (and the new stream ``[T, hc, D]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, to_bf16
from .triton_dependent_launch import launch_arguments, let_next_kernel_start, wait_for_previous_kernel
from .triton_mhc import store_expanded
from .triton_rms_norm import BOTH, PLAIN, check_outputs, normed_row, row_warps, store_normed


EXPAND_CHUNK = 1024  # the expand's columns at a time: its hc copies of them in fp32 fit in registers


@triton.jit
def _sublayer_input_kernel(stream_ptr, output_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, out_ptr, out2_ptr,
                           D, inv_d, stride_st, stride_sh, stride_ot, stride_rt, stride_rh, stride_p, stride_o,
                           stride_o2, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr, EXPAND: tl.constexpr,
                           CHUNK: tl.constexpr, OUTPUTS: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a model weight: before the wait
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    if EXPAND:  # the new stream (triton_mhc.expand's arithmetic), written, then read back by the collapse
        for chunk in tl.static_range(BLOCK_D // CHUNK):
            chunk_cols = chunk * CHUNK + tl.arange(0, CHUNK)
            store_expanded(output_ptr + t * stride_ot, residual_ptr + t * stride_rt, post_ptr + t * HC,
                           comb_ptr + t * (HC * HC), stream_ptr + t * stride_st, stride_rh, stride_sh, chunk_cols,
                           chunk_cols < D, HC, INTERPRETED)
        tl.debug_barrier()  # every thread's part of the stream stored before any thread reads it back
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
    bf16, pre ``[T, hc]`` -> ``[T, D]`` bf16 (``BOTH``: the pair of normed rows and their FP8 round trip)."""
    return _launch(stream, None, pre, weight, eps, pdl, outputs)


def expand_and_sublayer_input(output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                              pre: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
                              outputs: int = PLAIN) -> tuple[torch.Tensor, ...]:
    """``stream = expand(output, residual, post, comb)``, then ``sublayer_input(stream, pre, ...)``, in one
    launch -> ``(stream [T, hc, D], normed [T, D])``, or ``(stream, normed, round trip)`` with ``BOTH``."""
    assert output.dtype == torch.bfloat16 and output.stride(-1) == 1, (output.dtype, output.stride())
    stream = torch.empty(residual.shape, dtype=torch.bfloat16, device=residual.device)
    normed = _launch(stream, (output, residual, post.float().contiguous(), comb.float().contiguous()), pre, weight,
                     eps, pdl, outputs)
    return (stream, *normed) if outputs == BOTH else (stream, normed)


def _launch(stream: torch.Tensor, expand: tuple[torch.Tensor, ...] | None, pre: torch.Tensor, weight: torch.Tensor,
            eps: float, pdl: bool, outputs: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The kernel over ``stream``, which ``expand = (output, residual, post, comb)`` writes first if given."""
    t, hc, d = stream.shape
    assert stream.dtype == torch.bfloat16 and stream.stride(-1) == 1, (stream.dtype, stream.stride())
    check_outputs(outputs, stream.dtype, d)
    out = torch.empty(t, d, dtype=torch.bfloat16, device=stream.device)
    out2 = torch.empty_like(out) if outputs == BOTH else out
    if t:
        output, residual, post, comb = expand if expand is not None else (out, stream, pre, pre)  # (unread)
        assert residual.stride(-1) == 1 and residual.shape == stream.shape, (residual.shape, residual.stride())
        pre = pre.float()
        block_d = triton.next_power_of_2(d)
        _sublayer_input_kernel[(t,)](
            stream, output, residual, post, comb, pre, weight, out, out2, d, 1.0 / d, stream.stride(0),
            stream.stride(1), output.stride(0), residual.stride(0), residual.stride(1), pre.stride(0), out.stride(0),
            out2.stride(0), float(eps), HC=hc, BLOCK_D=block_d, EXPAND=expand is not None,
            CHUNK=min(block_d, EXPAND_CHUNK), OUTPUTS=outputs,
            INTERPRETED=INTERPRETED, num_warps=row_warps(block_d), enable_fp_fusion=False,
            **launch_arguments(pdl, stream.device))
    return (out, out2) if outputs == BOTH else out
