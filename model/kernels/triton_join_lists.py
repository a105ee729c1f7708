"""Triton kernel that joins each query's window list and compressed list (twin: ``model.attention_lists``'s
``join_lists`` in torch).

``join_lists(window_index, window_valid, window_widths, compressed_index, compressed_counts,
compressed_widths)``: row ``t`` of the joined list takes its first ``window_widths[t]`` columns from
the window part, then the compressed part from its column 0 (so the compressed entries follow the
window's listed columns, with nothing between them), up to ``W + K`` columns; a column is valid if
its source is (a window column's flag; a compressed column below ``compressed_counts[t]``) and it
lies below the row's length ``window_widths[t] + compressed_widths[t]``. Integer work only: the
kernel's output is the twin's, bit for bit. Torch takes ~15 kernels for it (the aranges, the source
columns, two concatenations, two gathers, the masks); a decode step joins once per compressed
layer group (``model/attention.py``).

Layouts: ``window_index [T, W]`` and ``compressed_index [T, K]`` int64, ``window_valid [T, W]``
bool, the three per-row counts ``[T]`` int64; out: index ``[T, W + K]`` int64, valid ``[T, W + K]``
bool, lengths ``[T]`` int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # list columns per program


@triton.jit
def _join_lists_kernel(window_index_ptr, window_valid_ptr, window_width_ptr, compressed_index_ptr,
                       compressed_count_ptr, compressed_width_ptr, index_ptr, valid_ptr, length_ptr, W, K,
                       stride_wi, stride_wv, stride_ci, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    total = W + K
    in_list = j < total
    window_width = tl.load(window_width_ptr + row)
    length = window_width + tl.load(compressed_width_ptr + row)
    source = tl.minimum(tl.where(j < window_width, j, W + j - window_width), total - 1)
    from_window = source < W
    entry = source - W  # the compressed column, where the source is not the window's
    index = tl.where(from_window,
                     tl.load(window_index_ptr + row * stride_wi + source, mask=in_list & from_window, other=0),
                     tl.load(compressed_index_ptr + row * stride_ci + entry, mask=in_list & ~from_window, other=0))
    valid = tl.where(from_window,
                     tl.load(window_valid_ptr + row * stride_wv + source, mask=in_list & from_window, other=0) != 0,
                     entry < tl.load(compressed_count_ptr + row))
    valid = valid & (j < length)
    tl.store(index_ptr + row * total + j, index, mask=in_list)
    tl.store(valid_ptr + row * total + j, valid.to(tl.uint8), mask=in_list)
    if tl.program_id(1) == 0:
        tl.store(length_ptr + row, length)


def join_lists(window_index: torch.Tensor, window_valid: torch.Tensor, window_widths: torch.Tensor,
               compressed_index: torch.Tensor, compressed_counts: torch.Tensor,
               compressed_widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index ``[T, W + K]``, valid ``[T, W + K]``, lengths ``[T]``) (module docstring)."""
    t, w = window_index.shape
    k = compressed_index.shape[1]
    device = window_index.device
    index = torch.empty(t, w + k, dtype=torch.int64, device=device)
    valid = torch.empty(t, w + k, dtype=torch.bool, device=device)
    lengths = torch.empty(t, dtype=torch.int64, device=device)
    if t:
        window_index, compressed_index = window_index.long().contiguous(), compressed_index.long().contiguous()
        window_valid = window_valid.contiguous().view(torch.uint8)  # same bytes; a bool pointer is awkward
        _join_lists_kernel[(t, triton.cdiv(w + k, BLOCK))](
            window_index, window_valid, window_widths.long().contiguous(), compressed_index,
            compressed_counts.long().contiguous(), compressed_widths.long().contiguous(), index,
            valid.view(torch.uint8), lengths, w, k, window_index.stride(0), window_valid.stride(0),
            compressed_index.stride(0), BLOCK=BLOCK, num_warps=4)
    return index, valid, lengths
