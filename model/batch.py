"""The flattened variable-length batch a forward runs on.

A forward takes the tokens of many sequences concatenated (no padding). Sequence ``b`` contributes
``lengths[b]`` consecutive positions starting at ``starts[b]`` (its number of already-cached
tokens): a prefill chunk of any length at any position, or one decode token. Its state lives in
state slot ``slots[b]`` and its paged blocks are ``block_tables[b]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


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

    @cached_property
    def layout(self) -> "TokenLayout":
        return TokenLayout.of(self)

    def rows(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b] + self.chunks[b].length)

    @classmethod
    def build(cls, token_ids: list[list[int]], starts: list[int], slots: list[int],
              block_tables: list[list[int]], previous_starts: list[int] | None = None,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        flat, positions, chunks = [], [], []
        for b, ids in enumerate(token_ids):
            flat.extend(ids)
            positions.extend(range(starts[b], starts[b] + len(ids)))
            chunks.append(SequenceChunk(
                start=starts[b], length=len(ids), slot=slots[b],
                block_table=torch.tensor(block_tables[b], dtype=torch.long, device=device),
                previous_start=-1 if previous_starts is None else previous_starts[b],
            ))
        return cls(torch.tensor(flat, dtype=torch.long, device=device),
                   torch.tensor(positions, dtype=torch.long, device=device), chunks)


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
            return torch.repeat_interleave(torch.tensor(values, dtype=torch.long), lengths).to(device)

        if chunks:
            tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
        else:
            tables = torch.zeros(0, 1, dtype=torch.long, device=device)
        return cls(seq=per_token(list(range(len(chunks)))), start=per_token([c.start for c in chunks]),
                   end=per_token([c.end for c in chunks]), offset=per_token(batch.offsets),
                   slot=per_token([c.slot for c in chunks]),
                   seq_end=torch.tensor([c.end for c in chunks], dtype=torch.long, device=device),
                   seq_slot=torch.tensor([c.slot for c in chunks], dtype=torch.long, device=device),
                   block_tables=tables)
