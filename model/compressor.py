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

from . import device_ranges
from .batch import ForwardBatch
from .cache import V41Cache
from .kernels import KernelBackend
from .layers import Linear
from .rope import RotaryTable


class Compressor:
    def __init__(self, layer_id: int, ratio: int, wkv: Linear, wgate: Linear | None, norm: torch.Tensor,
                 index_wk: Linear, index_k_norm: torch.Tensor, eps: float, rope_dims: int, kernels: KernelBackend):
        self.layer_id, self.ratio = layer_id, ratio
        self.kernels = kernels
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
        keys = self.kernels.rms_norm(self.index_wk(latents), self.index_k_norm, self.eps)
        keys = self.kernels.rotary_fp4_round_trip(keys, entry_positions, rope, self.rope_dims, 32, e4m3_scale=False)
        # latents: a fresh tensor that nothing else reads, so RoPE may rotate it in place
        kv = self.kernels.rotary_fp4_round_trip(latents, entry_positions, rope, self.rope_dims, 16, e4m3_scale=True)
        cache.write_entries_paged(self.layer_id, batch.layout.block_tables, seq_of_entry, entry_ids, kv, keys)

    def latents(self, x: torch.Tensor, batch: ForwardBatch, cache: V41Cache):
        """Pre-RoPE latents of every group closed in this forward, with their sequence and entry id.

        Updates the compressor tails of the sequences (the open group at the end of each chunk)."""
        device = x.device
        if x.shape[0] == 0:
            nothing = torch.empty(0, dtype=torch.long, device=device)
            return x.new_empty(0, self.norm.shape[0]), nothing, nothing
        layout, pos = batch.layout, batch.positions
        if self.ratio == 1:
            return self.kernels.rms_norm(self.wkv(x), self.norm, self.eps), layout.seq, pos
        r = self.ratio
        # fp32 projections, as the reference's fp32 copies give them
        kv = self.kernels.fp32_linear(x, self.wkv.weight)
        score = self.kernels.fp32_linear(x, self.wgate.weight)
        tail_kv, tail_score = cache.tail_kv[self.layer_id], cache.tail_score[self.layer_id]
        if batch.padded:
            group_kv, group_score = self._padded_groups(kv, score, tail_kv, tail_score, layout.slot, pos)
            closing_seq, closing_pos = layout.seq, pos
        else:
            group_kv, group_score, closing = self._chunk_groups(kv, score, tail_kv, tail_score, batch)
            closing_seq, closing_pos = layout.seq[closing], pos[closing]
        latents = (group_kv * group_score.softmax(dim=1)).sum(dim=1)
        latents = self.kernels.rms_norm(latents.to(x.dtype), self.norm, self.eps)
        return latents, closing_seq, closing_pos // r

    def _padded_groups(self, kv: torch.Tensor, score: torch.Tensor, tail_kv: torch.Tensor, tail_score: torch.Tensor,
                       slot: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded decode batch's groups ``[T, r, D]``, every row as if it closed its group: the
        entry of a row that does not close lands on its still-open group's entry, which no query can
        see yet and whose closing token overwrites it (fixed shapes: no nonzero, no host read). Each
        row is its sequence's newest token, so it writes its own tail row first (a closing token's
        row is never read again) and then reads its whole group from the tail: the same values as
        taking its own from ``kv``, in 7 launches where the general path takes 28."""
        r = self.ratio
        ring = pos % r
        tail_kv[slot, ring] = kv
        tail_score[slot, ring] = score
        members = (pos.unsqueeze(-1) + device_ranges.arange(r + 1, pos.device)[1:]) % r  # positions pos - r + 1 .. pos
        return tail_kv[slot.unsqueeze(-1), members], tail_score[slot.unsqueeze(-1), members]

    def _chunk_groups(self, kv: torch.Tensor, score: torch.Tensor, tail_kv: torch.Tensor, tail_score: torch.Tensor,
                      batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The groups ``[G, r, D]`` that close in a chunked batch, and the rows that close them. A group
        closes at the token whose position is its last; its earlier members come from this chunk or,
        if they came in an earlier forward, from the sequence's tail."""
        r, layout, pos = self.ratio, batch.layout, batch.positions
        closing = batch.closing_rows(r)
        members = pos[closing].unsqueeze(-1) - (r - 1) + device_ranges.arange(r, pos.device)  # [G, r]
        start = layout.start[closing].unsqueeze(-1)
        in_chunk = (members >= start).unsqueeze(-1)
        local = layout.offset[closing].unsqueeze(-1) + (members - start).clamp(min=0)
        slots = layout.slot[closing].unsqueeze(-1)
        group_kv = torch.where(in_chunk, kv[local], tail_kv[slots, members % r])
        group_score = torch.where(in_chunk, score[local], tail_score[slots, members % r])
        # tokens of a group still open at the end of their chunk wait in the tail, row = position % r
        waiting = batch.rows_from(lambda chunk: chunk.end // r * r)
        tail_kv[layout.slot[waiting], pos[waiting] % r] = kv[waiting]
        tail_score[layout.slot[waiting], pos[waiting] % r] = score[waiting]
        return group_kv, group_score, closing
