"""Sparse single-KV-head attention with an attention sink (the kernel every V4.1 layer calls).

Each query row attends to an explicit list of KV rows (window entries and selected compressed
entries; -1 marks an unused slot). K and V are the same vector. The arithmetic follows the
official kernel: an online softmax over blocks of 64 listed entries, scores in fp32, the
probabilities rounded to bf16 (relative to the running max) before the P.V product, the
denominator summing fp32 probabilities, and the sink entering only the denominator, unscaled.
A row with no valid entry yields zeros.

The result of a row depends on where its valid entries sit in its list (which 64-block, holes
between them, the list's length), so callers decide the layout (see ``attention.py``). Two forms:

* ``sparse_attention`` (the reference layout): rows grouped by list length, the last block as long
  as the list, as in the reference kernel; needed to reproduce the reference bit for bit.
* ``sparse_attention_padded`` (the engine's packed layout): every list padded with holes to whole
  64-entry blocks, so that a row's result no longer depends on its list's length, and every row
  runs at the batch's width in one pass: no shape depends on the values (no host synchronisation,
  and what a CUDA graph needs). Rows with
lists of equal length are processed together; each row's products are its own batched matrix
products, so a row's result does not depend on the other rows.
"""

from __future__ import annotations

import torch

BLOCK = 64  # listed entries per online-softmax step


def sparse_attention(q: torch.Tensor, kv_rows: torch.Tensor, valid: torch.Tensor, widths: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of each query row over its own listed KV rows.

    q: [T, H, D] bf16; kv_rows: [T, L, D] bf16, the listed entries of each row; valid: [T, L] bool
    (False marks a hole, the kernel's -1); widths: [T] list length of each row (columns beyond it
    are not part of the row's list); sink: [H] fp32. Returns [T, H, D] bf16.
    """
    t, h, d = q.shape
    out = torch.zeros(t, h, d, dtype=torch.bfloat16, device=q.device)
    for width in torch.unique(widths).tolist():
        if width == 0:
            continue  # no entry: the kernel returns zeros
        rows = torch.nonzero(widths == width).squeeze(1)
        out[rows] = _attend_rows(q[rows], kv_rows[rows, :width], valid[rows, :width], sink, scale, whole_blocks=False)
    return out


def sparse_attention_padded(q: torch.Tensor, kv_rows: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Every row's list at the full width L of ``kv_rows``, padded with holes to whole 64-entry blocks.

    Listed entries past a row's own width are holes, and a block of holes leaves the online softmax
    exactly as it was (the running max, the sum and the output are unchanged), so a row's result is
    the same at any width: in a batch, alone, or padded for a CUDA graph. A row without any valid
    entry yields zeros."""
    return _attend_rows(q, kv_rows, valid, sink, scale, whole_blocks=True)


def _attend_rows(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                 scale: float, whole_blocks: bool) -> torch.Tensor:
    """Rows whose lists have the same length: kv [T, L, D], valid [T, L]."""
    t, h, d = q.shape
    if whole_blocks and kv.shape[1] % BLOCK:
        pad = -kv.shape[1] % BLOCK
        kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))  # holes
    scale_t = torch.tensor(scale, dtype=torch.float32)
    qf = q.float()
    acc_o = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    sum_exp = torch.zeros(t, h, dtype=torch.float32, device=q.device)
    # finite start so exp(old_max - new_max) is 0, not NaN, on the first block
    running_max = torch.full((t, h), -1e30, dtype=torch.float32, device=q.device)
    for start in range(0, kv.shape[1], BLOCK):
        ok = valid[:, start:start + BLOCK]
        kv_block = kv[:, start:start + BLOCK].float() * ok.unsqueeze(-1)  # holes are zero rows
        scores = torch.bmm(qf, kv_block.transpose(1, 2))  # [T, H, blk]
        scores = torch.where(ok.unsqueeze(1), scores, -torch.inf) * scale_t
        previous_max = running_max
        running_max = torch.maximum(previous_max, scores.amax(dim=-1))
        rescale = torch.exp(previous_max - running_max)
        p = torch.exp(scores - running_max.unsqueeze(-1))
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        acc_o = acc_o * rescale.unsqueeze(-1) + torch.bmm(p.to(torch.bfloat16).float(), kv_block)
    sum_exp = sum_exp + torch.exp(sink.float() - running_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16)
