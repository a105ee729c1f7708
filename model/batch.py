"""The flattened variable-length batch a forward runs on.

A forward takes the tokens of many sequences concatenated (no padding). Sequence ``b`` contributes
``lengths[b]`` consecutive positions starting at ``starts[b]`` (its number of already-cached
tokens): a prefill chunk of any length at any position, or one decode token. Its state lives in
state slot ``slots[b]`` and its paged blocks are ``block_tables[b]``.

Which rows a module must touch (the tokens that close a compressor group, the last positions of
each chunk that a sequence's ring keeps, ...) follow from the chunks' positions, which the host
knows: ``ForwardBatch`` computes them there and uploads them as index tensors, so no module has to
read a mask back from the device (a host synchronisation) to find them.

A *padded decode* batch (``ForwardBatch.padded_decode``) is the fixed-shape form a CUDA graph
replays: one token per row, every per-row value a device tensor (nothing the host must read), rows
beyond the real ones pointing at a scratch slot and block, and the indexer's key width fixed by
``key_tokens`` instead of read from the batch. Modules that would otherwise pick rows by a
data-dependent mask (which needs a host synchronisation) process every row of such a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from . import device_ranges
from .device_upload import upload


@dataclass
class SequenceChunk:
    """One sequence's part of a forward, as the model needs it."""

    start: int  # first position of the chunk = tokens already cached
    length: int  # tokens in this forward
    slot: int
    block_table: torch.Tensor  # [num_blocks_of_sequence] int64
    previous_start: int = -1  # start of the sequence's previous forward (-1: none); official hand-off only

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    chunks: list[SequenceChunk]
    offsets: list[int] = field(default_factory=list)  # first flat row of each chunk
    # padded decode batches only: the longest context (tokens) the indexer pads its keys to
    key_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.offsets:
            acc, offsets = 0, []
            for chunk in self.chunks:
                offsets.append(acc)
                acc += chunk.length
            self.offsets = offsets

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def padded(self) -> bool:
        """A fixed-shape decode batch: every row is processed, no row set is read back to the host."""
        return self.key_tokens is not None

    @property
    def num_sequences(self) -> int:
        return int(self.positions.shape[0]) if self.padded else len(self.chunks)

    @cached_property
    def layout(self) -> "TokenLayout":
        return TokenLayout.of(self)

    def rows_from(self, first_position: Callable[[SequenceChunk], int]) -> torch.Tensor:
        """Flat rows (device int64) of every chunk's positions ``>= first_position(chunk)``."""
        rows: list[int] = []
        for offset, chunk in zip(self.offsets, self.chunks):
            first = max(first_position(chunk), chunk.start)
            rows.extend(range(offset + first - chunk.start, offset + chunk.length))
        return upload(rows, torch.long, self.token_ids.device)

    def closing_rows(self, ratio: int) -> torch.Tensor:
        """Flat rows (device int64) of the tokens whose position ends a group of ``ratio`` positions."""
        rows: list[int] = []
        for offset, chunk in zip(self.offsets, self.chunks):
            first = chunk.start + (ratio - 1 - chunk.start) % ratio  # first p >= start with (p + 1) % ratio == 0
            rows.extend(range(offset + first - chunk.start, offset + chunk.length, ratio))
        return upload(rows, torch.long, self.token_ids.device)

    def longest_end(self) -> int:
        """The largest chunk end (tokens a sequence holds after this forward), known on the host."""
        return max((chunk.end for chunk in self.chunks), default=0)

    @classmethod
    def padded_decode(cls, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, key_tokens: int) -> "ForwardBatch":
        """One decode token per row, from device tensors [B] (and block tables [B, W]) that the
        caller refills before every run; ``key_tokens`` bounds every row's context (position + 1)."""
        rows = device_ranges.arange(positions.shape[0], positions.device)
        batch = cls(token_ids, positions, [], offsets=[], key_tokens=key_tokens)
        batch.layout = TokenLayout(seq=rows, start=positions, end=positions + 1, offset=rows, slot=slots,
                                   seq_end=positions + 1, seq_slot=slots, block_tables=block_tables)
        return batch

    def rows(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b] + self.chunks[b].length)

    @classmethod
    def build(cls, token_ids: list[list[int]], starts: list[int], slots: list[int],
              block_tables: list[list[int]], previous_starts: list[int] | None = None,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        device = torch.device(device)
        flat, positions, chunks = [], [], []
        for b, ids in enumerate(token_ids):
            flat.extend(ids)
            positions.extend(range(starts[b], starts[b] + len(ids)))
            chunks.append(SequenceChunk(
                start=starts[b], length=len(ids), slot=slots[b],
                block_table=upload(block_tables[b], torch.long, device),
                previous_start=-1 if previous_starts is None else previous_starts[b],
            ))
        return cls(upload(flat, torch.long, device), upload(positions, torch.long, device), chunks)


@dataclass(frozen=True)
class TokenLayout:
    """Per-token and per-sequence index tensors (on the batch's device), so that the per-sequence
    parts of a forward (window, compressor, indexer, n-gram history) run as batched gathers and
    scatters instead of Python loops over sequences."""

    seq: torch.Tensor  # [T] sequence (chunk) index of each token
    start: torch.Tensor  # [T] first position of the token's chunk
    end: torch.Tensor  # [T] one past the last position of the token's chunk
    offset: torch.Tensor  # [T] flat row of the first token of the token's chunk
    slot: torch.Tensor  # [T] state slot of the token's sequence
    seq_end: torch.Tensor  # [B] chunk ends
    seq_slot: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max blocks], padded with block 0

    @classmethod
    def of(cls, batch: ForwardBatch) -> "TokenLayout":
        device = batch.token_ids.device
        chunks = batch.chunks
        lengths = torch.tensor([c.length for c in chunks], dtype=torch.long)

        def per_token(values: list[int]) -> torch.Tensor:
            return upload(torch.repeat_interleave(torch.tensor(values, dtype=torch.long), lengths), torch.long, device)

        if chunks:
            tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
        else:
            tables = torch.zeros(0, 1, dtype=torch.long, device=device)
        return cls(seq=per_token(list(range(len(chunks)))), start=per_token([c.start for c in chunks]),
                   end=per_token([c.end for c in chunks]), offset=per_token(batch.offsets),
                   slot=per_token([c.slot for c in chunks]),
                   seq_end=upload([c.end for c in chunks], torch.long, device),
                   seq_slot=upload([c.slot for c in chunks], torch.long, device),
                   block_tables=tables)
