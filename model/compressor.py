"""The CSA2 compressor of a kv-source layer: compressed KV entries and their index keys.

Ratio 1: every token becomes one entry, ``norm(wkv(x))``. Ratio r > 1: the tokens of group g
(positions g*r .. g*r+r-1) are pooled with a per-channel softmax gate in fp32, then normalised;
the entry appears once the group's last token is seen. A group that is still open at the end of a
forward waits in the sequence's compressor tail (state slot), so a prompt prefilled in chunks of
any size, or token by token, yields the same entries.

For each new entry (the pre-RoPE latent) the layer then derives its index key
``k_norm(wk(latent))``, and both get RoPE at the group's first position and their FP4 round trip
(keys: group 32, UE8M0 scales; KV: group 16, E4M3 scales) before being written into the blocks.
"""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .cache import V41Cache
from .layers import Linear, rms_norm
from .quant import fp4_qdq
from .rope import RotaryTable


class Compressor:
    def __init__(self, layer_id: int, ratio: int, wkv: Linear, wgate: Linear | None, norm: torch.Tensor,
                 index_wk: Linear, index_k_norm: torch.Tensor, eps: float, rope_dims: int):
        self.layer_id, self.ratio = layer_id, ratio
        self.wkv, self.wgate, self.norm = wkv, wgate, norm
        self.index_wk, self.index_k_norm = index_wk, index_k_norm
        self.eps, self.rope_dims = eps, rope_dims

    def to(self, device) -> "Compressor":
        self.wkv.to(device)
        self.index_wk.to(device)
        if self.wgate is not None:
            self.wgate.to(device)
        self.norm, self.index_k_norm = self.norm.to(device), self.index_k_norm.to(device)
        return self

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: V41Cache, rope: RotaryTable) -> None:
        """Compress the chunk ``x [T, D]`` (attention input) and write new entries into ``cache``."""
        latents, seq_of_entry, entry_ids = self.latents(x, batch, cache)
        if latents.shape[0] == 0:
            return
        entry_positions = entry_ids * self.ratio  # an entry stands for its group's first token
        keys = rms_norm(self.index_wk(latents), self.index_k_norm, self.eps)
        rope.rotate_(keys[:, -self.rope_dims:], entry_positions)
        keys = fp4_qdq(keys, 32)
        kv = latents.clone()
        rope.rotate_(kv[:, -self.rope_dims:], entry_positions)
        kv = fp4_qdq(kv, 16, e4m3_scale=True)
        for b, chunk in enumerate(batch.chunks):
            mine = seq_of_entry == b
            if not bool(mine.any()):
                continue
            blocks, rows = cache.entry_rows(self.layer_id, chunk.block_table, entry_ids[mine])
            cache.compressed_kv[self.layer_id][blocks, rows] = kv[mine]
            cache.index_keys[self.layer_id][blocks, rows] = keys[mine]

    def latents(self, x: torch.Tensor, batch: ForwardBatch, cache: V41Cache):
        """Pre-RoPE latents of every group closed in this forward, with their sequence and entry id.

        Updates the compressor tails of the sequences (the open group at the end of each chunk)."""
        device = x.device
        if x.shape[0] == 0:
            nothing = torch.empty(0, dtype=torch.long, device=device)
            return x.new_empty(0, self.norm.shape[0]), nothing, nothing
        if self.ratio == 1:
            latents = rms_norm(self.wkv(x), self.norm, self.eps)
            seq_of_entry = torch.cat([torch.full((c.length,), b, dtype=torch.long, device=device)
                                      for b, c in enumerate(batch.chunks)])
            return latents, seq_of_entry, batch.positions
        r = self.ratio
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)  # fp32 projections
        tail_kv, tail_score = cache.tail_kv[self.layer_id], cache.tail_score[self.layer_id]
        pooled_kv, pooled_score, seqs, entries = [], [], [], []
        for b, chunk in enumerate(batch.chunks):
            rows = batch.rows(b)
            first_group, end_group = chunk.start // r, chunk.end // r  # groups closing: [first, end)
            carried = chunk.start - first_group * r  # open-group tokens from earlier forwards
            if end_group > first_group:
                n_closed = (end_group - first_group) * r - carried
                group_kv = torch.cat([tail_kv[chunk.slot, :carried], kv[rows][:n_closed]])
                group_score = torch.cat([tail_score[chunk.slot, :carried], score[rows][:n_closed]])
                pooled_kv.append(group_kv.unflatten(0, (-1, r)))
                pooled_score.append(group_score.unflatten(0, (-1, r)))
                seqs.append(torch.full((end_group - first_group,), b, dtype=torch.long, device=device))
                entries.append(torch.arange(first_group, end_group, device=device))
            # tokens of the group still open after this chunk wait in the tail, row = position % r
            open_from = max(end_group * r, chunk.start)
            if chunk.end > open_from:
                tail_rows = torch.arange(open_from, chunk.end, device=device) % r
                local = slice(rows.start + open_from - chunk.start, rows.stop)
                tail_kv[chunk.slot, tail_rows] = kv[local]
                tail_score[chunk.slot, tail_rows] = score[local]
        if not pooled_kv:
            empty = x.new_empty(0, self.norm.shape[0])
            return empty, torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device)
        group_kv, group_score = torch.cat(pooled_kv), torch.cat(pooled_score)
        latents = (group_kv * group_score.softmax(dim=1)).sum(dim=1)
        latents = rms_norm(latents.to(x.dtype), self.norm, self.eps)
        return latents, torch.cat(seqs), torch.cat(entries)
