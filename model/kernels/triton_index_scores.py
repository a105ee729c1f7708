"""Triton kernel of the lightning indexer's scores (twin: ``ReferenceKernels.index_scores``).

``index_scores(q, weights, keys, seq)``: for each query row ``t`` and each entry ``e`` of its
sequence's keys, ``score[t, e] = sum_h weights[t, h] * relu(q[t, h] . keys[seq[t], e])`` with the
reference's bf16 roundings: the dot product accumulates in fp32 and is rounded to bf16 (what a bf16
matrix product returns), the ReLU'd value times the head weight is rounded to bf16 (a bf16
elementwise product), and the heads are summed in fp32 and rounded to bf16 once.

Why a kernel: the twin gathers every query's keys (``keys[seq]``, ``[T, E, d]``: 4 GiB for an
8K-token prefill chunk over 2K entries, so it must go a slice of queries at a time), writes the
``[T, H, E]`` per-head products and reads them back three times. Here each program holds one
query's heads (``[H, d]``, 16 KB at V4.1's 64 x 128) and streams blocks of ``BLOCK_E`` of its
sequence's keys straight from ``keys``: one tensor-core product ``[H, d] x [d, BLOCK_E]`` per block,
the roundings, the weighted sum over heads in registers, one bf16 row of scores written.

Layouts: q ``[T, H, d]`` bf16, weights ``[T, H]`` bf16, keys ``[B, E, d]`` bf16 (last dims
contiguous), seq ``[T]`` int64 (each query's row of ``keys``); out ``[T, E]`` bf16. ``H`` and ``d``
are powers of two of at least 16.

Arithmetic against the twin: the same roundings in the same places; only the order of the fp32
sums differs (inside the dot products, and over the heads), so now and then a bf16 rounding lands
on the other side: a score may differ by one bf16 ulp, which can swap entries that tie or nearly
tie in the top-k (``tests/test_triton_index_scores.py`` states the check). Each (query, key block)
is computed alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, dot_bf16, to_bf16

BLOCK_E = 64  # keys per program


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, seq_ptr, out_ptr, E, stride_qt, stride_qh, stride_wt, stride_kb,
                         stride_ke, stride_ot, H: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    entries = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    heads = tl.arange(0, H)
    dims = tl.arange(0, D)
    e_mask = entries < E
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :])  # [H, D]
    weights = tl.load(w_ptr + t * stride_wt + heads).to(tl.float32)  # [H]
    row = tl.load(seq_ptr + t)
    keys_t = tl.load(k_ptr + row * stride_kb + entries[None, :] * stride_ke + dims[:, None],
                     mask=e_mask[None, :], other=0.0)  # [D, BLOCK_E]
    per_head = to_bf16(dot_bf16(q, keys_t, INTERPRETED), INTERPRETED).to(tl.float32)  # [H, BLOCK_E]
    weighted = to_bf16(tl.maximum(per_head, 0.0) * weights[:, None], INTERPRETED).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + entries, to_bf16(tl.sum(weighted, axis=0), INTERPRETED), mask=e_mask)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """q ``[T, H, d]``, weights ``[T, H]``, keys ``[B, E, d]`` (bf16), seq ``[T]`` -> scores ``[T, E]`` bf16."""
    t, h, d = q.shape
    e = keys.shape[1]
    out = torch.empty(t, e, dtype=torch.bfloat16, device=q.device)
    if t == 0 or e == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    _index_scores_kernel[(t, triton.cdiv(e, BLOCK_E))](
        q, weights, keys, seq, out, e, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1),
        out.stride(0), H=h, D=d, BLOCK_E=BLOCK_E, INTERPRETED=INTERPRETED, num_warps=4, enable_fp_fusion=False)
    return out
