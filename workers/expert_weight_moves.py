"""Moving expert weights between ranks when the placement changes while serving.

For one MoE layer, ``plan_moves`` lists what every slot needs from the old placement to the new:
nothing (it holds that expert already), a copy from another slot of the same rank, or a transfer
from a rank that holds the expert now (the holder with the fewest transfers planned so far, then
the lowest rank: the work is spread and every rank plans the same list without talking).
``apply_moves`` then runs one ``all_to_all_single`` of packed expert rows (every projection's
values and scales of one expert, as bytes; split sizes known from the plan on every rank), and
writes the slots in place: the stacks keep their addresses (what a captured CUDA graph holds),
and only the moved experts take extra memory, for the time of the exchange. Every rank calls it
for every layer; a layer where nothing crosses ranks makes no collective call at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.kernels import ExpertWeights, QuantizedWeight


@dataclass(frozen=True)
class ExpertMove:
    """Copy the expert in slot ``source_slot`` of ``source_rank`` into slot ``target_slot`` of
    ``target_rank`` (slots local to their rank)."""

    source_rank: int
    source_slot: int
    target_rank: int
    target_slot: int

    @property
    def crosses_ranks(self) -> bool:
        return self.source_rank != self.target_rank


def plan_moves(old: Sequence[int], new: Sequence[int], world_size: int) -> list[ExpertMove]:
    """What one layer needs to go from slots ``old`` to ``new`` (the logical expert of every global slot)."""
    if len(old) != len(new) or len(old) % world_size:
        raise ValueError("both placements need the same number of slots, split evenly over the ranks")
    per_rank = len(old) // world_size
    held = [list(old[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
    sends = [0] * world_size
    moves = []
    for rank in range(world_size):
        for slot in range(per_rank):
            expert = new[rank * per_rank + slot]
            if held[rank][slot] == expert:
                continue
            if expert in held[rank]:
                moves.append(ExpertMove(rank, held[rank].index(expert), rank, slot))
                continue
            holders = [r for r in range(world_size) if expert in held[r]]
            if not holders:
                raise ValueError(f"expert {expert} is in no slot of the old placement")
            source = min(holders, key=lambda r: (sends[r], r))
            sends[source] += 1
            moves.append(ExpertMove(source, held[source].index(expert), rank, slot))
    return moves


def expert_tensors(experts: ExpertWeights) -> list[torch.Tensor]:
    """Every stacked tensor of a layer's experts (values and scales), each ``[slots, ...]``."""
    tensors = []
    for weight in (experts.w1, experts.w3, experts.w2):
        tensors += [weight.values, weight.scales] if isinstance(weight, QuantizedWeight) else [weight]
    return tensors


def apply_moves(experts: ExpertWeights, moves: list[ExpertMove], rank: int, world_size: int, group=None) -> int:
    """Carry out one layer's ``moves`` on this rank (collective when a move crosses ranks: every rank
    must call it with the same moves). Returns how many slots of this rank were rewritten."""
    views = []
    for tensor in expert_tensors(experts):
        if not tensor.is_contiguous():
            raise ValueError("expert stacks must be contiguous to be rewritten in place")
        views.append(tensor.view(tensor.shape[0], -1).view(torch.uint8))  # the same memory, as bytes
    device = views[0].device

    def rows(slots: list[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.long, device=device)
        return torch.cat([view.index_select(0, index) for view in views], dim=1)

    outgoing = sorted((m for m in moves if m.source_rank == rank and m.crosses_ranks),
                      key=lambda m: (m.target_rank, m.target_slot))
    incoming = sorted((m for m in moves if m.target_rank == rank and m.crosses_ranks),
                      key=lambda m: (m.source_rank, m.target_slot))
    local = [m for m in moves if m.source_rank == m.target_rank == rank]
    # read every source before any slot is written: a slot may be both
    staged_local = rows([m.source_slot for m in local])
    writes = [([m.target_slot for m in local], staged_local)]
    if any(m.crosses_ranks for m in moves):
        sent = rows([m.source_slot for m in outgoing])
        received = sent.new_empty(len(incoming), sent.shape[1])
        send_splits = [sum(1 for m in outgoing if m.target_rank == r) for r in range(world_size)]
        receive_splits = [sum(1 for m in incoming if m.source_rank == r) for r in range(world_size)]
        dist.all_to_all_single(received, sent, receive_splits, send_splits, group=group)
        writes.append(([m.target_slot for m in incoming], received))
    for slots, data in writes:
        if not slots:
            continue
        index = torch.tensor(slots, dtype=torch.long, device=device)
        column = 0
        for view in views:
            view.index_copy_(0, index, data[:, column:column + view.shape[1]])
            column += view.shape[1]
    return len(local) + len(incoming)
