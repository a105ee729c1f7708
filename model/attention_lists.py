"""Which KV rows a query attends to, and in which order (the lists ``sparse_attention`` consumes, as
indices into the forward's pool of rows).

A query at position t attends to the window positions ``t-n+1 .. t`` (n = min(window, t+1)) and,
in compressed layers, to the compressed entries selected for it. Since the kernel's arithmetic
depends on where entries sit in the list (64-entry blocks, holes), the order is a deliberate
choice with two layouts:

* **packed** (default): window entries in position order, then selected entries in entry order,
  nothing else. A row's list depends only on its position and selection, so chunked prefill,
  decode and batching all give every row the same list.
* **reference**: the lists the official kernels build. A prefill chunk starting at position 0 with
  S tokens lists ``min(S, window)`` window columns (valid entries first, holes after) then
  ``min(index_topk, visible)`` compressed columns; a single-token step lists the whole ring,
  oldest first (holes first while it fills), then the compressed columns. Other chunks (the
  reference never runs them) list ``window`` columns, valid first. Used to reproduce the
  reference bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import device_ranges
from .batch import TokenLayout


@dataclass
class TokenSelection:
    """Compressed entries selected for every query of a forward (one row per token)."""

    entries: torch.Tensor  # [T, K] int64, ascending; columns >= counts are unused
    counts: torch.Tensor  # [T] valid entries
    widths: torch.Tensor  # [T] columns of the reference kernel's list (min(index_topk, visible at chunk end))


@dataclass
class WindowList:
    positions: torch.Tensor  # [T, window] listed positions (arbitrary where not valid)
    valid: torch.Tensor  # [T, window]
    widths: torch.Tensor  # [T] columns of the list that belong to the window part


def window_list(positions: torch.Tensor, layout: TokenLayout, window: int, reference_layout: bool) -> WindowList:
    counts = torch.clamp(positions + 1, max=window)
    cols = device_ranges.arange(window, positions.device)
    valid_first = positions.unsqueeze(-1) - (counts - 1).unsqueeze(-1) + cols
    if not reference_layout:
        return WindowList(valid_first, cols < counts.unsqueeze(-1), counts)
    chunk_len = layout.end - layout.start
    ring_order = (chunk_len == 1) & (layout.start > 0)  # a decode step lists the ring, oldest first
    widths = torch.where(layout.start == 0, chunk_len.clamp(max=window), torch.full_like(counts, window))
    holes_first = cols >= (window - counts).unsqueeze(-1)
    listed = torch.where(ring_order.unsqueeze(-1), positions.unsqueeze(-1) - (window - 1 - cols), valid_first)
    valid = torch.where(ring_order.unsqueeze(-1), holes_first, cols < counts.unsqueeze(-1))
    return WindowList(listed, valid, torch.where(ring_order, window, widths))


def join_lists(window: WindowList, window_index: torch.Tensor, selection: TokenSelection | None,
               compressed_index: torch.Tensor | None, reference_layout: bool):
    """(index [T, L], valid [T, L], list length [T]): each query's list as indices into the forward's
    row pool (``window_index [T, window]`` and ``compressed_index [T, K]`` say where the pool holds
    each window position and each selected entry): the window part, then the compressed part.

    The compressed part starts right after the window part of each row: after the valid window
    entries (packed), or after the kernel's window columns (reference). On CUDA one Triton launch
    (``kernels/triton_join_lists.py``) computes what ``joined_lists`` computes here in ~15 torch
    kernels: the same integers."""
    if selection is None:
        return window_index, window.valid, window.widths
    compressed_width = selection.widths if reference_layout else selection.counts
    parts = (window_index, window.valid, window.widths, compressed_index, selection.counts, compressed_width)
    if window_index.is_cuda:
        from .kernels.triton_join_lists import join_lists as join_on_gpu

        return join_on_gpu(*parts)
    return joined_lists(*parts)


def joined_lists(window_index: torch.Tensor, window_valid: torch.Tensor, window_widths: torch.Tensor,
                 compressed_index: torch.Tensor, compressed_counts: torch.Tensor,
                 compressed_widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``join_lists`` on the parts' tensors: row t takes ``window_widths[t]`` window columns, then the
    compressed ones (``compressed_counts[t]`` valid), ``window_widths[t] + compressed_widths[t]`` long."""
    w, k = window_index.shape[1], compressed_index.shape[1]
    compressed_valid = device_ranges.arange(k, window_index.device) < compressed_counts.unsqueeze(-1)
    j = device_ranges.arange(w + k, window_index.device)
    win_width = window_widths.unsqueeze(-1)
    source = torch.where(j < win_width, j, w + j - win_width).clamp(max=w + k - 1)
    index = torch.gather(torch.cat([window_index, compressed_index], dim=1), 1, source)
    widths = window_widths + compressed_widths
    valid = torch.gather(torch.cat([window_valid, compressed_valid], dim=1), 1, source) & (j < widths.unsqueeze(-1))
    return index, valid, widths
