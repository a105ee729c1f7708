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

from . import device_ranges
from .attention_lists import TokenSelection
from .batch import ForwardBatch
from .cache import V41Cache
from .device_upload import upload
from .kernels import KernelBackend
from .layers import Linear
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


def top_entries(scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
    """Per row, the ``k_per_row`` highest scores (ties: lower entry first), as entry ids in increasing
    order in the first columns of ``[S, k_max]`` (the others 0)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k_max]
    unused = device_ranges.arange(k_max, scores.device) >= k_per_row.unsqueeze(-1)
    big = torch.iinfo(torch.long).max
    return torch.sort(order.masked_fill(unused, big), dim=-1).values.masked_fill(unused, 0)


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """First level of the two-level selection: bool [S, E] mask of the entries in each query's
    best blocks. ``scores`` has -inf at entries the query cannot see."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    num_blocks = block_scores.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")  # the query's partly filled block
    block_ids = device_ranges.arange(num_blocks, scores.device)
    block_scores = block_scores.masked_fill(block_ids == newest.unsqueeze(-1), torch.inf)
    return best_blocks(block_scores, topk_blocks).repeat_interleave(block_size, dim=-1)[:, :width]


def best_blocks(block_scores: torch.Tensor, topk_blocks: int) -> torch.Tensor:
    """bool [S, N]: each row's ``topk_blocks`` best blocks (ties: the lower block), those above -inf."""
    if topk_blocks >= block_scores.shape[-1]:
        # every block ranks among the best (V4.1 keeps 2,048 blocks of 8 entries: any context below
        # 64K tokens): no sort, the same mask
        return block_scores > -torch.inf
    ranked = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, ranked.indices[:, :topk_blocks], ranked.values[:, :topk_blocks] > -torch.inf)
    return keep


SCORE_ELEMENTS = 2**27  # elements of the largest per-query key or per-head score tensor made at once


class Indexer:
    def __init__(self, layer_id: int, ratio: int, wq_b: Linear, weights_proj: Linear, num_heads: int,
                 head_dim: int, rope_dims: int, topk: int, is_candidate_source: bool, uses_candidates: bool,
                 candidate_topk_blocks: int, candidate_block_size: int, batch_invariant: bool, kernels: KernelBackend):
        self.layer_id, self.ratio = layer_id, ratio
        self.kernels = kernels
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

    def queries(self, x: torch.Tensor, projected: torch.Tensor, positions: torch.Tensor, rope: RotaryTable):
        """Index queries [T, H, d] (RoPE'd, FP4 round trip) and per-head weights [T, H] for all tokens, from
        ``projected = wq_b(qr)`` [T, H * d] (the attention projects it with its own ``wq_b``: one launch)."""
        q = projected.unflatten(-1, (self.num_heads, self.head_dim))
        q = self.kernels.rotary_fp4_round_trip(q, positions, rope, self.rope_dims, 32, e4m3_scale=False)
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
        return self._pick(self._scores(q, weights, keys), positions, candidates)

    def _pick(self, scores: torch.Tensor, positions: torch.Tensor,
              candidates: torch.Tensor | None) -> tuple[Selection, torch.Tensor | None]:
        """Visibility, the two-level candidate logic and the top-k on scores [S, E]."""
        num_entries = scores.shape[-1]
        visible = visible_entries(positions, self.ratio)
        hidden = device_ranges.arange(num_entries, scores.device) >= visible.unsqueeze(-1)
        scores = scores.masked_fill(hidden, -torch.inf)
        published = None
        if self.is_candidate_source:
            published = candidate_mask(scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
        elif self.uses_candidates and candidates is not None:
            scores = scores.masked_fill(~candidates, -torch.inf)
        k_per_row = visible.clamp(max=self.topk)
        entries = self.kernels.top_entries(scores, k_per_row, min(self.topk, num_entries))
        return Selection(entries, k_per_row), published

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[S, E] bf16: sum over heads of weight * relu(q . k), with the reference's bf16 roundings;
        keys [E, d] shared by the S queries (one sequence's chunk)."""
        if self.batch_invariant:
            # one [H, d] x [d, E] product per query: what the reference computes in a decode step
            per_head = torch.bmm(q, keys.t().unsqueeze(0).expand(q.shape[0], -1, -1))
        else:
            per_head = torch.einsum("shd,ed->she", q, keys)
        return (per_head.relu_() * weights.unsqueeze(-1)).sum(dim=1)

    # ------------------------------------------------------------------ whole batch
    def select_all(self, x: torch.Tensor, projected: torch.Tensor, batch: ForwardBatch, cache: V41Cache, rope: RotaryTable,
                   key_layers: list[int], candidates: torch.Tensor | None,
                   per_sequence: bool) -> tuple[TokenSelection, torch.Tensor | None]:
        """Selections of every query of the batch, and the candidate mask [T, E] the candidate source
        publishes (E = visible entries at the end of the longest chunk).

        ``per_sequence`` scores each sequence's chunk with one product, as the reference does in its
        prefill (used to reproduce it bit for bit); otherwise each query is its own product, all
        sequences at once, keys padded to the longest sequence. ``projected``: ``wq_b(qr)`` (``queries``)."""
        q, weights = self.queries(x, projected, batch.positions, rope)
        layout = batch.layout
        if batch.padded:  # a fixed width, so that the shapes do not depend on the batch's values
            width = batch.key_tokens // self.ratio
        else:
            width = batch.longest_end() // self.ratio  # known on the host: nothing read back from the device
        t = batch.num_tokens
        if width == 0:
            empty = Selection.empty(t, x.device)
            return TokenSelection(empty.entries, empty.counts, torch.zeros_like(empty.counts)), None
        keys = self._padded_keys(cache, layout, key_layers, width, x.device)  # [B, E, d]
        # rows' slices (below): a decode step, or any chunk the backend scores at once, is one slice,
        # whose selection is the batch's (no zeroed buffers to copy it into: ~5 launches per indexer)
        step = max(1, SCORE_ELEMENTS // self.kernels.index_score_row_elements(q.shape[1], q.shape[2], width))
        if not per_sequence and step >= t:
            scores = self.kernels.index_scores(q, weights, keys, layout.seq)
            selection, published = self._pick(scores, batch.positions, candidates)
            # a padded decode row is its sequence's newest token: what it sees is what the sequence has
            widths = selection.counts if batch.padded else self._widths(layout)
            return TokenSelection(selection.entries, selection.counts, widths), published
        k_max = min(self.topk, width)
        num_keys = layout.seq_end // self.ratio  # visible entries at the end of each chunk
        entries = torch.zeros(t, k_max, dtype=torch.long, device=x.device)
        counts = torch.zeros(t, dtype=torch.long, device=x.device)
        published = torch.zeros(t, width, dtype=torch.bool, device=x.device) if self.is_candidate_source else None
        if per_sequence:
            for b, chunk in enumerate(batch.chunks):
                rows, n = batch.rows(b), int(num_keys[b])
                cand = candidates[rows, :n] if candidates is not None else None
                selection, mask = self.select(q[rows], weights[rows], keys[b, :n], batch.positions[rows], cand)
                entries[rows, : selection.entries.shape[1]] = selection.entries
                counts[rows] = selection.counts
                if mask is not None:
                    published[rows, :n] = mask
        else:
            # every query its own product against its sequence's keys, a slice of queries at a time:
            # the reference backend's per-query keys and per-head scores of a long prefill chunk
            # would not fit at once (8K queries x 8K keys x 128 dims is 16 GiB), nor would the
            # float scores of the top-k; the Triton backend makes only rows of scores, so an 8K chunk
            # takes one slice instead of ~16, each a few launches the host would have to keep up with.
            # Rows are independent, so slicing changes no bit
            for start in range(0, t, step):
                rows = slice(start, min(start + step, t))
                scores = self.kernels.index_scores(q[rows], weights[rows], keys, layout.seq[rows])
                cand = candidates[rows] if candidates is not None else None
                selection, mask = self._pick(scores, batch.positions[rows], cand)
                entries[rows] = selection.entries
                counts[rows] = selection.counts
                if mask is not None:
                    published[rows] = mask
        return TokenSelection(entries, counts, self._widths(layout)), published

    def _widths(self, layout) -> torch.Tensor:
        """[T] the reference kernel's list width of each query: min(top-k, entries visible at the end
        of its chunk)."""
        return (layout.seq_end // self.ratio)[layout.seq].clamp(max=self.topk)

    def _padded_keys(self, cache: V41Cache, layout, key_layers: list[int], width: int, device) -> torch.Tensor:
        """[B, E, d]: the first E index keys of every sequence, from its key layer's cache."""
        entries = device_ranges.arange(width, device)
        seqs = device_ranges.arange(layout.seq_end.numel(), device)
        keys = None
        for key_layer in sorted(set(key_layers)):
            gathered = cache.read_index_keys_paged(key_layer, layout.block_tables, seqs.unsqueeze(-1),
                                                   entries.unsqueeze(0))
            if keys is None:
                keys = gathered
            else:
                use = upload([k == key_layer for k in key_layers], torch.bool, device)
                keys = torch.where(use.view(-1, 1, 1), gathered, keys)
        return keys
