"""Where V4.1 keeps per-sequence state between forwards: paged blocks and state slots.

Two kinds of state, with different lifetimes and growth:

* **Paged blocks** (grow with the sequence): a block covers ``block_size`` source tokens (128 by
  default) and holds, for every kv-source layer of compress ratio r, ``block_size // r`` compressed
  KV entries and as many index keys. Entry g of a sequence (tokens g*r .. g*r+r-1) lives in block
  ``block_table[g*r // block_size]`` at row ``g % (block_size // r)``. Block 0 is never handed out:
  it is the padding target of unused block-table entries.
* **State slots** (fixed size per sequence): the sliding-window ring of every layer (position p in
  row ``p % window``), the ratio-r compressor tail of every kv-source layer with r > 1 (the kv and
  score rows of the still-open group, row ``p % r``), and the Engram n-gram history (compressed ids
  of the last ``max_ngram_size - 1`` positions, row ``p % (max_ngram_size - 1)``).

Window KV, compressed KV and index keys are stored in their FP8/FP4 formats (model/cache_formats.py:
codes and scales, the bytes the reference's round trips define); what the model reads back are the
bf16 values of those round trips, bit for bit. Compressor tails stay fp32 and the Engram history
int64. On V4.1-Flash the paged cache takes 890 bytes per token (``kv_bytes_per_token``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_formats import COMPRESSED_KV, INDEX_KEYS, WINDOW_KV, QuantizedRows, RowCodec, RowsWrite
from .config import V41Config

DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class CacheGeometry:
    block_size: int  # source tokens per paged block
    num_blocks: int  # including the padding block 0
    num_slots: int

    def entries_per_block(self, ratio: int) -> int:
        return self.block_size // ratio


def check_block_size(cfg: V41Config, block_size: int) -> None:
    for layer in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[layer]
        if block_size % ratio:
            raise ValueError(f"block size {block_size} is not a multiple of compress ratio {ratio}")


def kv_bytes_per_token(cfg: V41Config) -> float:
    """Paged cache bytes per token over all layers: the compressed KV and index key rows of every
    kv-source layer, a ratio-r layer adding one row of each per r tokens. On V4.1-Flash (sources 2,
    8, 14 at ratio 2 and 20 at ratio 1; 288-byte KV rows, 68-byte key rows) that is
    (3/2 + 1) * (288 + 68) = 890. The per-sequence state slot (``bytes_per_slot``) is not counted."""
    return sum(_entry_bytes(cfg) / cfg.compress_ratios[layer] for layer in cfg.kv_source_layers)


def _entry_bytes(cfg: V41Config) -> int:
    """One compressed entry: its KV row and its index key row."""
    return COMPRESSED_KV.row_bytes(cfg.head_dim) + INDEX_KEYS.row_bytes(cfg.index_head_dim)


def bytes_per_block(cfg: V41Config, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Memory of one paged block (compressed KV + index keys of every kv-source layer)."""
    return sum(block_size // cfg.compress_ratios[layer] * _entry_bytes(cfg) for layer in cfg.kv_source_layers)


def bytes_per_slot(cfg: V41Config) -> int:
    """Memory of one state slot: FP8 window rings, fp32 compressor tails, int64 Engram history."""
    total = cfg.num_layers * cfg.sliding_window * WINDOW_KV.row_bytes(cfg.head_dim)
    for layer in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[layer]
        if ratio > 1:
            total += 2 * ratio * cfg.head_dim * 4
    return total + max(cfg.engram_max_ngram_size - 1, 1) * 8


class V41Cache:
    """All per-sequence state tensors of one model replica, allocated once."""

    def __init__(self, cfg: V41Config, geometry: CacheGeometry, device: torch.device | str = "cpu"):
        check_block_size(cfg, geometry.block_size)
        self.cfg = cfg
        self.geometry = geometry
        self.device = torch.device(device)
        slots, window, hd = geometry.num_slots, cfg.sliding_window, cfg.head_dim
        window_codec = RowCodec(WINDOW_KV, hd, device)
        kv_codec = RowCodec(COMPRESSED_KV, hd, device)
        key_codec = RowCodec(INDEX_KEYS, cfg.index_head_dim, device)
        self.window = [QuantizedRows(window_codec, (slots, window), device) for _ in range(cfg.num_layers)]
        self.compressed_kv: dict[int, QuantizedRows] = {}
        self.index_keys: dict[int, QuantizedRows] = {}
        self.tail_kv: dict[int, torch.Tensor] = {}
        self.tail_score: dict[int, torch.Tensor] = {}
        for layer in cfg.kv_source_layers:
            ratio = cfg.compress_ratios[layer]
            entries = geometry.entries_per_block(ratio)
            self.compressed_kv[layer] = QuantizedRows(kv_codec, (geometry.num_blocks, entries), device)
            self.index_keys[layer] = QuantizedRows(key_codec, (geometry.num_blocks, entries), device)
            if ratio > 1:
                self.tail_kv[layer] = torch.zeros(slots, ratio, hd, dtype=torch.float32, device=device)
                self.tail_score[layer] = torch.full((slots, ratio, hd), -torch.inf, dtype=torch.float32,
                                                    device=device)
        self.history_len = max(cfg.engram_max_ngram_size - 1, 1)
        self.engram_history = torch.zeros(slots, self.history_len, dtype=torch.int64, device=device)

    @classmethod
    def allocate(cls, cfg: V41Config, num_blocks: int, num_slots: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, device: torch.device | str = "cpu") -> "V41Cache":
        return cls(cfg, CacheGeometry(block_size, num_blocks, num_slots), device)

    @staticmethod
    def storage_summary() -> str:
        """The formats the cache holds its values in, as the startup summary shows them."""
        return (f"window {WINDOW_KV.describe()}, compressed KV {COMPRESSED_KV.describe()}, "
                f"index keys {INDEX_KEYS.describe()}")

    # ------------------------------------------------------------------ values in, values out
    # The model reads and writes cache values only through these methods, so how the values are
    # stored (their byte layout) is this class's business alone. Values written are outputs of
    # their round trips (window: fp8_qdq group 32; KV: fp4_qdq group 16 E4M3; keys: fp4_qdq group
    # 32); reads give those bf16 values back bit for bit.
    def read_window(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Window KV rows ``[..., head_dim]`` bf16 at (slot, ring row) pairs of broadcastable shapes."""
        return self.window[layer].read(slots, rows)

    def write_window(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.window[layer].write(slots, rows, values=values)

    def window_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The (slot, ring row) pairs as row numbers that every layer's window store shares (they are
        all of one shape): a forward computes them once for ``read_window_rows`` / ``write_window_rows``."""
        return self.window[0].flat_rows(slots, rows)

    def read_window_rows(self, layer: int, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.window[layer].read_rows(rows, out)

    def write_window_rows(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.window[layer].write_rows(rows, values)

    def window_write(self, layer: int, rows: torch.Tensor) -> RowsWrite:
        """``write_window_rows`` of values still to be made: for the kernel that makes them to store them too."""
        return RowsWrite(self.window[layer], rows)

    def read_compressed_kv(self, layer: int, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Compressed KV entries ``[..., head_dim]`` bf16 at (block, row) pairs."""
        return self.compressed_kv[layer].read(blocks, rows)

    def read_index_keys(self, layer: int, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Index keys ``[..., index_head_dim]`` bf16 at (block, row) pairs."""
        return self.index_keys[layer].read(blocks, rows)

    def read_compressed_kv_paged(self, layer: int, block_tables: torch.Tensor, seq: torch.Tensor,
                                 entries: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed KV ``[S, K, head_dim]`` bf16 of entries ``entries`` of sequences ``seq`` (broadcast
        to ``[S, K]``), given the batch's padded block tables ``[B, max blocks]`` (into ``out``, contiguous,
        if given). Entries past a sequence's table land in its last column's block: callers mask them out."""
        return self.compressed_kv[layer].read_entries(block_tables, seq, entries, out)

    def read_index_keys_paged(self, layer: int, block_tables: torch.Tensor, seq: torch.Tensor,
                              entries: torch.Tensor) -> torch.Tensor:
        """Index keys ``[S, K, index_head_dim]`` bf16 of paged entries (``read_compressed_kv_paged``)."""
        return self.index_keys[layer].read_entries(block_tables, seq, entries)

    def write_entries_paged(self, layer: int, block_tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor,
                            kv: torch.Tensor, keys: torch.Tensor) -> None:
        """New compressed entries ``[G]`` of sequences ``seq [G]`` of ``layer``: their KV ``[G, head_dim]``
        and index keys (already through their round trips), through the padded block tables."""
        seq, entries = seq.reshape(1, -1), entries.reshape(1, -1)
        self.compressed_kv[layer].write_entries(block_tables, seq, entries, kv.unsqueeze(0))
        self.index_keys[layer].write_entries(block_tables, seq, entries, keys.unsqueeze(0))

    def entry_rows(self, layer: int, block_table: torch.Tensor, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of compressed entries ``entries`` (any shape) of one sequence in ``layer``'s cache."""
        per_block = self.geometry.entries_per_block(self.cfg.compress_ratios[layer])
        return block_table[entries // per_block], entries % per_block
