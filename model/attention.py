"""One V4.1 attention layer: a sliding window of raw KV plus, for compressed layers, the
compressed entries its indexer (or the indexer it reuses) selected, in one sparse attention call.

Queries and the window KV come from low-rank projections; the window KV (``kv_norm(wkv(x))`` with
RoPE) goes through an FP8 round trip over all head dims. Every query lists its entries the same
way, whatever the chunking or the batch: the window positions ``t-n+1 .. t`` (n = min(window,
t+1)) in position order, then its selected compressed entries in entry order. The output has the
query's rotation removed from its RoPE dims and is projected back through a grouped low-rank
output (``wo_a`` per group in bf16, then ``wo_b``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import device_ranges
from .batch import ForwardBatch
from .cache import V41Cache
from .attention_lists import TokenSelection, WindowList, join_lists, window_list
from .compressor import Compressor
from .config import LayerRole, V41Config
from .indexer import Indexer
from .kernels import KernelBackend, QuantizedWeight
from .layers import Linear, project, quantized
from .rope import RotaryTable
from .sparse_attention import sparse_attention


@dataclass
class ForwardState:
    """What attention layers hand down the stack within one forward."""

    selections: dict[int, TokenSelection] = field(default_factory=dict)  # index source -> per-token selection
    candidates: torch.Tensor | None = None  # [T, E] published by the candidate source
    index_key_layer: dict[int, list[int]] = field(default_factory=dict)  # index source -> key layer per seq
    # what several layers of the forward compute alike, computed by the first that needs it: every
    # layer's window lists are the same, and so are the compressed parts of layers that share their KV
    # and selection sources (a decode step's CUDA graph then records ~30 fewer small kernels per layer)
    shared: dict[tuple, Any] = field(default_factory=dict)

    def once(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``'s value for ``key``: computed by the first caller of the forward, then shared."""
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]


@dataclass
class AttentionWeights:
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: QuantizedWeight | torch.Tensor  # [groups * o_lora_rank, heads * head_dim / groups]
    wo_b: Linear
    sink: torch.Tensor  # [heads] fp32


def sequence_entries_pay(sequences: int, entries_per_sequence: int, tokens: int, selected: int) -> bool:
    """Whether decoding every sequence's compressed entries once reads fewer rows than decoding each
    query's selected ones (both give the attention the same rows)."""
    return sequences * entries_per_sequence < tokens * selected


class Attention:
    def __init__(self, cfg: V41Config, role: LayerRole, weights: AttentionWeights,
                 compressor: Compressor | None, indexer: Indexer | None, kernels: KernelBackend,
                 reference_layout: bool, device: torch.device | str = "cpu", max_positions: int = 0):
        self.cfg, self.role, self.w = cfg, role, weights
        self.kernels = kernels
        self.compressor, self.indexer = compressor, indexer
        self.reference_layout = reference_layout
        self.rope = RotaryTable.for_layer(cfg, role.compress_ratio, device, max_positions)
        self.scale = cfg.head_dim ** -0.5

    def to(self, device) -> "Attention":
        w = self.w
        for lin in (w.wq_a, w.wq_b, w.wkv, w.wo_b):
            lin.to(device)
        w.q_norm, w.kv_norm, w.wo_a, w.sink = (t.to(device) for t in (w.q_norm, w.kv_norm, w.wo_a, w.sink))
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.to(device)
        self.rope = self.rope.to(device)
        return self

    def __call__(self, x: torch.Tensor, x_fp8: torch.Tensor, batch: ForwardBatch, cache: V41Cache,
                 state: ForwardState) -> torch.Tensor:
        """``x``: the normed rows; ``x_fp8``: the same as FP8-ready rows (``rms_norm_and_fp8_ready``), which
        ``wq_a`` and ``wkv`` take when both are quantized."""
        cfg, w, pos = self.cfg, self.w, batch.positions
        rd = cfg.rope_head_dim
        eps = cfg.rms_norm_eps
        # the compressor reads only x and writes the entries the indexer and the gather below read: it runs
        # beside the queries' launches (model/kernels/side_stream.py)
        compressing = (self.kernels.beside(x, lambda: self.compressor(x, batch, cache, self.rope))
                       if self.compressor is not None else None)  # (a kv source's: a compressed layer's)
        fp8_input = quantized(w.wq_a, w.wkv)
        q_low_rank, kv_projected = project(x_fp8 if fp8_input else x, w.wq_a, w.wkv, prepared=fp8_input)
        indexed = self.role.compress_ratio and self.indexer is not None  # the indexer's queries come from qr too
        query_linears = (w.wq_b, self.indexer.wq_b) if indexed else (w.wq_b,)
        fp8_query = quantized(*query_linears)  # qr goes to these alone
        qr = self.kernels.rms_norm(q_low_rank, w.q_norm, eps, fp8_ready=fp8_query)
        q, *index_q = project(qr, *query_linears, prepared=fp8_query)
        index_q = index_q[0] if indexed else None
        q = q.unflatten(-1, (cfg.num_heads, cfg.head_dim))
        self.kernels.rotate_(q[..., -rd:], pos, self.rope)

        if compressing is not None:
            compressing.result()
        if self.role.compress_ratio:
            if self.indexer is not None:
                self._select(x, index_q, batch, cache, state)
        if batch.num_tokens:
            pool, index, valid, widths = self._gather_entries(kv_projected, batch, cache, state)
            kv = pool[:batch.num_tokens]  # the layer's KV rows (normed, rotated, FP8 round trip): the pool's head
            if self.reference_layout:
                o = sparse_attention(q, pool[index], valid, widths, w.sink, self.scale)
                self.kernels.rotate_(o[..., -rd:], pos, self.rope, inverse=True)
            else:  # whole blocks: every row at the batch's width gives each row what its own width gives
                o = self.kernels.sparse_attention_rotated_back(q, pool, index, valid, w.sink, self.scale, pos,
                                                               self.rope, rd)
        else:
            o, kv = torch.zeros_like(q), kv_projected[:0]
        self._write_window(kv, batch, cache, state)
        return w.wo_b(self._grouped_output(o, fp8_ready=w.wo_b.quantized), prepared=w.wo_b.quantized)

    # ------------------------------------------------------------------ compressed entries
    def _select(self, x, index_q, batch: ForwardBatch, cache: V41Cache, state: ForwardState) -> None:
        """Run this layer's indexer over the batch and publish its selection (and candidates)."""
        candidates = state.candidates if self.indexer.uses_candidates else None
        selection, published = self.indexer.select_all(
            x, index_q, batch, cache, self.rope, state.index_key_layer[self.role.layer_id], candidates,
            per_sequence=self.reference_layout)
        state.selections[self.role.layer_id] = selection
        if self.role.is_candidate_source:
            state.candidates = published

    def _gather_entries(self, kv: torch.Tensor, batch: ForwardBatch, cache: V41Cache, state: ForwardState):
        """(pool [R, D], index [T, L], valid [T, L], list lengths [T]): every KV row the queries list,
        each held once (the chunk's own rows, the rings of its sequences, the compressed entries), and
        each query's list as indices into it. Queries of one prefill chunk share most of their rows:
        copying them per query would move thousands of times the bytes. ``kv``: ``wkv``'s output, whose
        rows the window's KV rows (normed, rotated, FP8 round trip) are made from, in the pool's head.

        The pool is assembled in place: one buffer per forward and group of layers that share their lists
        (the window layers; each kv source and top-k source), its compressed entries decoded into it once,
        and each layer's own rows (the chunk's, the ring's) written into its head in turn (after the layer
        before has attended: one stream orders them), so no layer concatenates the three (at batch 256 of a
        1K context, ~100 MB a layer) or copies its chunk's rows."""
        layout, win = batch.layout, self.cfg.sliding_window
        ring_rows = state.once(("window ring rows",), lambda: cache.window_rows(
            layout.seq_slot.unsqueeze(-1), device_ranges.arange(win, kv.device)))
        window, window_index = state.once(("window lists",), lambda: self._window_index(batch, kv.shape[0]))
        own = kv.shape[0] + ring_rows.numel()  # the layer's own rows: the chunk's, then the ring's
        if not self.role.compress_ratio:
            pool = state.once(("window pool",), lambda: kv.new_empty(own, kv.shape[1]))
            index, valid, widths = window_index, window.valid, window.widths
        else:
            # the compressed part: the source layer wrote its entries before the first of its readers
            # gets here, and nothing writes them again within the forward
            key = ("compressed lists", self.role.kv_source, self.role.topk_source)
            pool, index, valid, widths = state.once(key, lambda: self._compressed_lists(
                batch, cache, state.selections[self.role.topk_source], window, window_index, kv, own))
        cfg = self.cfg
        # a decode step's rows go into the rings here, in the launch that makes them, before the rings are read:
        # each overwrites its sequence's position - window, which no list holds (the window ends one later)
        ring = cache.window_write(self.role.layer_id, self._decode_ring_rows(batch, cache, state)) \
            if batch.padded else None
        self.kernels.window_kv(kv, self.w.kv_norm, cfg.rms_norm_eps, batch.positions, self.rope, cfg.rope_head_dim,
                               out=pool[:kv.shape[0]], ring=ring)
        cache.read_window_rows(self.role.layer_id, ring_rows, out=pool[kv.shape[0]:own])
        return pool, index, valid, widths

    def _window_index(self, batch: ForwardBatch, tokens: int):
        """(window lists, where the pool holds each listed position): the chunk's own rows first, then
        the ring of each sequence (``window`` rows, ring row = position % window)."""
        layout, win = batch.layout, self.cfg.sliding_window
        window = window_list(batch.positions, layout, win, self.reference_layout)
        start, offset = layout.start.unsqueeze(-1), layout.offset.unsqueeze(-1)
        ring_row = window.positions.clamp(min=0) % win
        from_ring = torch.add(ring_row, layout.seq.unsqueeze(-1), alpha=win) + tokens
        if batch.padded:  # each row is its sequence's one new token: the chunk holds only that position
            return window, torch.where(window.positions >= start, offset, from_ring)
        last = (layout.end - layout.start - 1).unsqueeze(-1)
        from_chunk = offset + (window.positions - start).clamp(min=0).minimum(last)
        return window, torch.where(window.positions >= start, from_chunk, from_ring)

    def _compressed_lists(self, batch: ForwardBatch, cache: V41Cache, selection: TokenSelection,
                          window: WindowList, window_index: torch.Tensor, kv: torch.Tensor, first_row: int):
        """(the pool, its compressed entries decoded from ``first_row`` on, and the joined lists: index,
        valid, widths)."""
        pool, compressed_index = self._compressed_entries(batch, cache, selection, kv, first_row)
        index, valid, widths = join_lists(window, window_index, selection, compressed_index, self.reference_layout)
        return pool, index, valid, widths

    def _compressed_entries(self, batch: ForwardBatch, cache: V41Cache, selection, kv: torch.Tensor,
                            first_row: int):
        """(pool [first_row + R, D] with the selected compressed rows from ``first_row`` on, index [T, K]
        of each selected entry in it): each sequence's entries decoded once when that reads fewer rows than
        every query's selection (a prefill chunk), else each query's selected entries (decode: one query per
        sequence; a fixed shape, as a CUDA graph needs)."""
        layout, source = batch.layout, self.role.kv_source
        tokens, k = selection.entries.shape
        sequences = layout.seq_end.shape[0]

        def pool_with(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            pool = kv.new_empty(first_row + rows, kv.shape[1])
            return pool, pool[first_row:]

        if not batch.padded:
            per_sequence = max(batch.longest_end() // self.cfg.compress_ratios[source], 1)  # known on the host
            if sequence_entries_pay(sequences, per_sequence, tokens, k):
                entries = device_ranges.arange(per_sequence, selection.entries.device)
                owner = device_ranges.arange(sequences, entries.device).unsqueeze(-1)
                index = (first_row + layout.seq.unsqueeze(-1) * per_sequence
                         + selection.entries.clamp(min=0, max=per_sequence - 1))
                pool, rows = pool_with(sequences * per_sequence)
                cache.read_compressed_kv_paged(source, layout.block_tables, owner, entries, out=rows)
                return pool, index
        index = device_ranges.arange(first_row + tokens * k, selection.entries.device)[first_row:].view(tokens, k)
        pool, rows = pool_with(tokens * k)
        cache.read_compressed_kv_paged(source, layout.block_tables, layout.seq.unsqueeze(-1), selection.entries,
                                       out=rows)
        return pool, index

    def _write_window(self, kv: torch.Tensor, batch: ForwardBatch, cache: V41Cache, state: ForwardState) -> None:
        """Keep the last ``window`` positions of every chunk in its sequence's ring (row = pos % W); a decode
        step's rows are there already (``_gather_entries``)."""
        if batch.padded or not batch.num_tokens:
            return
        keep, rows = state.once(("window write rows",), lambda: self._kept_rows(batch, cache))
        cache.write_window_rows(self.role.layer_id, rows, kv[keep])

    def _decode_ring_rows(self, batch: ForwardBatch, cache: V41Cache, state: ForwardState) -> torch.Tensor:
        """A decode step's rows in the window stores: one token per row, each its sequence's newest position."""
        win, layout, pos = self.cfg.sliding_window, batch.layout, batch.positions
        return state.once(("window write rows",), lambda: cache.window_rows(layout.slot, pos % win))

    def _kept_rows(self, batch: ForwardBatch, cache: V41Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens among a chunk's last ``window``, and their rows in the window stores)."""
        keep = batch.rows_from(lambda chunk: chunk.end - self.cfg.sliding_window)
        return keep, cache.window_rows(batch.layout.slot[keep], batch.positions[keep] % self.cfg.sliding_window)

    def _grouped_output(self, o: torch.Tensor, fp8_ready: bool) -> torch.Tensor:
        """[T, H, D] -> [T, groups * o_lora_rank]: each group of heads through its own slice of wo_a (as
        FP8-ready rows with ``fp8_ready``: they go to ``wo_b`` alone)."""
        cfg = self.cfg
        grouped = o.reshape(o.shape[0], cfg.o_groups, cfg.num_heads * cfg.head_dim // cfg.o_groups)
        return self.kernels.grouped_dequantized_linear(grouped, self.w.wo_a, fp8_ready).flatten(1)
