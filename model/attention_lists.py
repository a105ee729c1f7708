"""Which KV rows a query attends to, and in which order (the lists ``sparse_attention`` consumes).

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

from .batch import SequenceChunk
from .indexer import Selection


@dataclass
class WindowList:
    positions: torch.Tensor  # [S, w] listed positions (arbitrary where not valid)
    valid: torch.Tensor  # [S, w]
    counts: torch.Tensor  # [S] valid entries per row


def window_list(positions: torch.Tensor, chunk: SequenceChunk, window: int, reference_layout: bool) -> WindowList:
    counts = torch.clamp(positions + 1, max=window)
    if reference_layout and chunk.length == 1 and chunk.start > 0:
        width = window
        cols = torch.arange(width, device=positions.device)
        first_valid = width - counts  # holes first: the ring listed oldest first while it fills
        valid = cols >= first_valid.unsqueeze(-1)
        listed = positions.unsqueeze(-1) - (width - 1 - cols)
        return WindowList(listed, valid, counts)
    width = min(chunk.length, window) if (reference_layout and chunk.start == 0) else window
    cols = torch.arange(width, device=positions.device)
    valid = cols < counts.unsqueeze(-1)
    listed = positions.unsqueeze(-1) - (counts - 1).unsqueeze(-1) + cols
    return WindowList(listed, valid, counts)


def join_lists(window: WindowList, window_rows: torch.Tensor, selection: Selection | None,
               compressed_rows: torch.Tensor | None, reference_layout: bool):
    """(kv rows [S, L, D], valid [S, L], list length [S]) of the window plus the selected entries."""
    s, w = window.valid.shape
    if selection is None:
        widths = torch.full_like(window.counts, w) if reference_layout else window.counts
        return window_rows, window.valid, widths
    k = selection.entries.shape[1]
    cols = torch.arange(k, device=window_rows.device)
    compressed_valid = cols < selection.counts.unsqueeze(-1)
    if reference_layout:
        rows = torch.cat([window_rows, compressed_rows], dim=1)
        valid = torch.cat([window.valid, compressed_valid], dim=1)
        return rows, valid, torch.full_like(window.counts, w + k)
    # packed: the valid window rows, then the valid compressed rows right after them
    j = torch.arange(w + k, device=window_rows.device)
    n = window.counts.unsqueeze(-1)
    source = torch.where(j < n, j, w + j - n).clamp(max=w + k - 1)
    both = torch.cat([window_rows, compressed_rows], dim=1)
    rows = torch.gather(both, 1, source.unsqueeze(-1).expand(-1, -1, both.shape[-1]))
    widths = window.counts + selection.counts
    return rows, j < widths.unsqueeze(-1), widths
