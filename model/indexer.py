"""The lightning indexer: which compressed entries each query attends to.

A small side attention scores every visible compressed entry for every query: FP4 index queries
(``index_n_heads`` heads) against one FP4 index key per entry, rectified, weighted per head by
``weights_proj(x)`` and summed over heads, in bf16 as the reference does. The ``index_topk``
best entries are kept. A query at position t sees the entries whose group has ended by t:
``(t + 1) // ratio`` of them.

Two-level selection: the candidate source layer first keeps, per query, the ``candidate_topk_blocks``
best blocks of ``candidate_block_size`` consecutive entries (a block scores as its best entry; the
block holding the query's newest entry is always kept); index sources after it score with their
own weights but only inside those candidate blocks.

Ties between equal bf16 scores are broken towards the lower entry (and the lower block), so the
selection is a deterministic function of the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import Linear
from .quant import fp4_qdq
from .rope import RotaryTable


@dataclass
class Selection:
    """Selected compressed entries of the queries of one sequence chunk."""

    entries: torch.Tensor  # [S, K] int64, ascending; columns >= counts[s] are unused
    counts: torch.Tensor  # [S] int64

    @staticmethod
    def empty(num_queries: int, device) -> "Selection":
        return Selection(torch.zeros(num_queries, 0, dtype=torch.long, device=device),
                         torch.zeros(num_queries, dtype=torch.long, device=device))


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed entries a query at each position can see: groups that ended at or before it."""
    return (positions + 1) // ratio


def top_entries(scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> Selection:
    """Per row, the ``k_per_row`` highest scores (ties: lower entry first), sorted by entry."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k_max]
    unused = torch.arange(k_max, device=scores.device) >= k_per_row.unsqueeze(-1)
    big = torch.iinfo(torch.long).max
    entries = torch.sort(order.masked_fill(unused, big), dim=-1).values.masked_fill(unused, 0)
    return Selection(entries, k_per_row)


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """First level of the two-level selection: bool [S, E] mask of the entries in each query's
    best blocks. ``scores`` has -inf at entries the query cannot see."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    num_blocks = block_scores.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")  # the query's partly filled block
    block_ids = torch.arange(num_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(block_ids == newest.unsqueeze(-1), torch.inf)
    take = min(topk_blocks, num_blocks)
    ranked = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, ranked.indices[:, :take], ranked.values[:, :take] > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[:, :width]


class Indexer:
    def __init__(self, layer_id: int, ratio: int, wq_b: Linear, weights_proj: Linear, num_heads: int,
                 head_dim: int, rope_dims: int, topk: int, is_candidate_source: bool, uses_candidates: bool,
                 candidate_topk_blocks: int, candidate_block_size: int, batch_invariant: bool):
        self.layer_id, self.ratio = layer_id, ratio
        self.wq_b, self.weights_proj = wq_b, weights_proj
        self.num_heads, self.head_dim, self.rope_dims, self.topk = num_heads, head_dim, rope_dims, topk
        self.is_candidate_source, self.uses_candidates = is_candidate_source, uses_candidates
        self.candidate_topk_blocks, self.candidate_block_size = candidate_topk_blocks, candidate_block_size
        self.batch_invariant = batch_invariant
        self.weight_scale = head_dim ** -0.5 * num_heads ** -0.5

    def to(self, device) -> "Indexer":
        self.wq_b.to(device)
        self.weights_proj.to(device)
        return self

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: RotaryTable):
        """Index queries [T, H, d] (RoPE'd, FP4 round trip) and per-head weights [T, H] for all tokens."""
        q = self.wq_b(qr).unflatten(-1, (self.num_heads, self.head_dim))
        rope.rotate_(q[..., -self.rope_dims:], positions)
        q = fp4_qdq(q, 32)
        weights = self.weights_proj(x) * self.weight_scale
        return q, weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               candidates: torch.Tensor | None) -> tuple[Selection, torch.Tensor | None]:
        """Top-k entries for the queries of one sequence chunk.

        q [S, H, d], weights [S, H], keys [E, d] (the entries visible by the end of the chunk),
        positions [S], candidates [S, E] from the candidate source (used if this layer uses them).
        Returns the selection and, for the candidate source, the candidate mask it publishes.
        """
        num_entries = keys.shape[0]
        if num_entries == 0:
            return Selection.empty(q.shape[0], q.device), None
        scores = self._scores(q, weights, keys)
        visible = visible_entries(positions, self.ratio)
        hidden = torch.arange(num_entries, device=q.device) >= visible.unsqueeze(-1)
        scores = scores.masked_fill(hidden, -torch.inf)
        published = None
        if self.is_candidate_source:
            published = candidate_mask(scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
        elif self.uses_candidates and candidates is not None:
            scores = scores.masked_fill(~candidates, -torch.inf)
        k_per_row = visible.clamp(max=self.topk)
        return top_entries(scores, k_per_row, min(self.topk, num_entries)), published

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[S, E] bf16: sum over heads of weight * relu(q . k), with the reference's bf16 roundings."""
        if self.batch_invariant:
            # one [H, d] x [d, E] product per query: what the reference computes in a decode step
            per_head = torch.bmm(q, keys.t().unsqueeze(0).expand(q.shape[0], -1, -1))
        else:
            per_head = torch.einsum("shd,ed->she", q, keys)
        return (per_head.relu_() * weights.unsqueeze(-1)).sum(dim=1)
