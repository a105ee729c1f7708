"""Expert parallelism: each rank holds ``S`` slots (physical copies of routed experts: a contiguous
range of the experts by default, or the slots of an ``ExpertPlacement`` with redundant copies); token
rows travel to the ranks holding their slots and the expert outputs travel back, through
torch.distributed all-to-all (gloo on CPU, NCCL on GPU). See docs/expert-parallel.md and
docs/expert-load-balance.md.

The dispatcher sees *slot* ids only: the MoE layer's expert map (``expert_load.LayerExpertMap``)
turns each (token, logical expert) pair into one slot first, and rank ``r`` holds slots
``r * S .. (r + 1) * S - 1``.

Per MoE layer: one **dispatch** and one **combine**, each a single ``all_to_all_single`` of a
buffer whose shape is fixed by the capacity (``expert_capacity.py``), never by the routing. When
the step's largest batch over the ranks is announced (``set_step_tokens``: every worker sees the
whole step plan, so no communication is needed) the blocks shrink to it, still equal on every rank:

* dispatch: every rank sends every peer a block of ``capacity`` records (plus one header record
  when a rank's batch may not fit). A record is one token row together with the token's ``k``
  slot ids and routing weights (ids of slots the peer does not hold are -1), so a token whose
  experts share a rank travels once. Records are placed without reading anything back to the host
  (a cumulative count gives each token its place in each peer's block); unused records are padding
  (all ids -1), which the expert kernel skips.
* the receiver runs its experts on every received record at once (``MoE.expert_rows``, through the
  kernel backend) and returns ``[records, k, D]``: the output of each (token, slot) pair whose
  expert it holds, in bf16, exactly what a single rank's kernel produces for that pair.
* combine: the returned blocks land back at the sender, which picks each pair's row and sums, per
  token, in increasing logical expert id (``model.moe.combine_routed``), so the result depends
  neither on the number of ranks nor on the placement (given row-independent expert kernels: the
  Triton kernels, or the reference kernels in batch-invariant mode). Partial sums are not formed on
  the expert side for that reason.

Overflow exists only when the capacity was lowered below the worst case: each block's header then
carries how many rows its sender could not fit, the receiver reads the headers back (one small
host read per layer), and the rows beyond capacity take a second, dynamic round (exchanges with
split sizes) through the same experts. They are counted (``stats``), never dropped.

The dispatch returns while the exchange is in flight (``async_op``): on NCCL it runs on the
communicator's own stream, on gloo on a background thread, so whatever the caller does before
``combine`` -- the shared expert -- overlaps it. Every rank takes part in every exchange, with zero
rows when it has no tokens (placeholder steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .expert_capacity import ExpertCapacity
from .expert_placement import ExpertPlacement

log = logging.getLogger(__name__)

NO_EXPERT = -1  # a slot id that no rank computes (the slot is elsewhere, or padding)

# The receiving side's experts: (rows [R, D], slot ids [R, k] global or NO_EXPERT, routing
# weights [R, k] fp32) -> per-pair outputs [R, k, D], zero where the slot is not this rank's.
ExpertRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RowRecord:
    """The bytes of one exchanged token row: ``[activation | k slot ids int32 | k weights fp32]``."""

    dim: int
    top_k: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.row_bytes + 8 * self.top_k

    def pack(self, rows: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``[R, nbytes]`` uint8 records of ``rows [R, D]``, ``ids [R, k]`` and ``gates [R, k]``."""
        records = torch.empty(rows.shape[0], self.nbytes, dtype=torch.uint8, device=rows.device)
        ids_at, gates_at = self.row_bytes, self.row_bytes + 4 * self.top_k
        records[:, :ids_at] = rows.contiguous().view(torch.uint8)
        records[:, ids_at:gates_at] = ids.to(torch.int32).view(torch.uint8)
        records[:, gates_at:] = gates.to(torch.float32).contiguous().view(torch.uint8)
        return records

    def unpack(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows ``[R, D]``, slot ids ``[R, k]`` int64, gates ``[R, k]`` fp32) of ``records``."""
        ids_at, gates_at = self.row_bytes, self.row_bytes + 4 * self.top_k
        rows = records[:, :ids_at].contiguous().view(self.dtype)
        ids = records[:, ids_at:gates_at].contiguous().view(torch.int32).long()
        gates = records[:, gates_at:].contiguous().view(torch.float32)
        return rows, ids, gates


@dataclass
class DispatchStats:
    """Counters of one rank's dispatcher since startup."""

    exchanges: int = 0  # MoE layers dispatched
    second_rounds: int = 0  # of them, those where some rank overflowed its capacity
    overflow_rows: int = 0  # token rows this rank sent in second rounds


@dataclass
class PendingExchange:
    """A dispatch in flight, and what the combine needs to put the returned rows in place."""

    work: dist.Work | None  # None: one rank holds every expert, nothing travels
    sent: torch.Tensor | None  # [W * block, record] kept alive until the exchange completes
    received: torch.Tensor | None  # [W * block, record] (filled when ``work`` completes)
    block: int  # records per peer (header included)
    source: torch.Tensor | None  # [n, k] row of the returned [W * block * k, D] output of each pair
    owner: torch.Tensor | None  # [n, k] rank holding each pair's expert
    overflow: torch.Tensor | None  # [n, W] (token, peer) rows left for a second round (lowered capacity only)
    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (gloo moves no bf16)."""
    return tensor.contiguous().view(torch.uint8)


class ExpertParallelDispatcher:
    """Moves one MoE layer's tokens to the ranks holding their experts and the outputs back.

    ``capacity`` None: no fixed capacity is known (the caller did not state its step limits);
    unless the step's tokens are announced, each exchange is then sized by the largest batch
    among the ranks, agreed by one small all-reduce read back to the host per layer. Pass an
    ``ExpertCapacity`` (``for_engine``) for static shapes."""

    def __init__(self, rank: int, world_size: int, num_experts: int, group=None,
                 capacity: ExpertCapacity | None = None, placement: ExpertPlacement | None = None):
        """``placement``: which rank holds which experts (None: the contiguous placement, no copies)."""
        if placement is None and num_experts % world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks")
        if placement is not None and (placement.num_experts, placement.world_size) != (num_experts, world_size):
            raise ValueError(f"the placement is for {placement.num_experts} experts over {placement.world_size} "
                             f"ranks, not {num_experts} over {world_size}")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.placement = placement  # updated by a rebalance (workers/expert_balancer.py)
        self.slots_per_rank = placement.slots_per_rank if placement is not None else num_experts // world_size
        self.capacity = capacity
        self.step_tokens: int | None = None  # see set_step_tokens
        self.stats = DispatchStats()
        slots = self.expert_range()
        sizing = capacity.describe() if capacity is not None else \
            "sized per layer by the largest batch of the ranks (no fixed capacity given)"
        held = f"experts {slots.start}-{slots.stop - 1} ({self.slots_per_rank} of {num_experts})"
        if placement is not None and not placement.is_contiguous():
            held = (f"slots {slots.start}-{slots.stop - 1} ({self.slots_per_rank} per layer of {placement.num_slots}: "
                    f"{num_experts} experts + {placement.num_redundant} redundant copies)")
        log.info("expert parallel: rank %d of %d holds %s; dispatch capacity: %s", rank, world_size, held, sizing)

    @classmethod
    def for_engine(cls, rank: int, world_size: int, num_experts: int, top_k: int, max_num_seqs: int,
                   max_num_batched_tokens: int, capacity_factor: float | None = None,
                   group=None, placement: ExpertPlacement | None = None) -> "ExpertParallelDispatcher":
        """The dispatcher of an engine rank, with the fixed capacity of its step limits."""
        capacity = ExpertCapacity.plan(max_num_seqs, max_num_batched_tokens, world_size=world_size,
                                       num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor)
        return cls(rank, world_size, num_experts, group, capacity, placement)

    @classmethod
    def for_config(cls, rank: int, config, cfg, group=None) -> "ExpertParallelDispatcher":
        """The dispatcher of an engine rank from the engine's ``EngineConfig`` and the model's
        ``V41Config``: capacity from the step limits, placement from the expert-load flags."""
        from .expert_balancer import startup_placement

        return cls.for_engine(rank, config.dp_size, cfg.num_routed_experts, cfg.num_experts_per_token,
                              config.max_num_seqs, config.max_num_batched_tokens, config.expert_capacity_factor,
                              group, startup_placement(config, cfg, rank))

    def expert_range(self) -> range:
        """The global slot ids this rank holds (with the contiguous placement: its expert ids)."""
        return range(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)

    def expert_shard(self):
        """What the loader loads on this rank (``model.loader.load_model``'s ``expert_range``)."""
        if self.placement is None:
            return self.expert_range()
        from model.loader import ExpertShard

        layers = tuple(self.placement.rank_experts(layer, self.rank) for layer in range(self.placement.num_layers))
        return ExpertShard(self.expert_range().start, layers)

    def set_step_tokens(self, max_tokens_per_rank: int | None) -> None:
        """Announce the most tokens any rank runs in the coming forwards (None: not known).

        Every worker receives the whole step plan, so all ranks announce the same number without
        communicating; exchanges then shrink to it (capped by the capacity), and a step that fits
        the capacity needs no overflow header and no host read. A CUDA graph captured for a padded
        batch size would announce that size. A rank with more tokens than announced is an error."""
        if max_tokens_per_rank is not None and max_tokens_per_rank < 0:
            raise ValueError(f"step tokens must be >= 0, got {max_tokens_per_rank}")
        self.step_tokens = max_tokens_per_rank

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> PendingExchange:
        """Start sending ``x [n, D]`` with its routing (``weights``, slot ids ``indices [n, k]``); returns at once."""
        n, k = indices.shape
        w, device = self.world_size, x.device
        if w == 1:  # every expert is here: an exchange would only copy the rows to themselves
            self._exchange_size(n, device)  # the same checks of the announced size
            self.stats.exchanges += 1
            return PendingExchange(None, None, None, 0, None, None, None, x, weights, indices)
        size, header = self._exchange_size(n, device)
        block = header + size
        owner = torch.div(indices, self.slots_per_rank, rounding_mode="floor")
        needs = torch.zeros(n, w, dtype=torch.bool, device=device).scatter_(1, owner, True)
        position = torch.cumsum(needs, dim=0) - 1  # each token's place among those sent to a peer
        fits = needs & (position < size)
        peers = torch.arange(w, device=device)
        # the record each (token, peer) fills; pairs that do not fit write past the end (one
        # discarded place each, so no two writes ever meet)
        beyond = w * block + torch.arange(n * w, device=device).view(n, w)
        slot = torch.where(fits, peers * block + header + position, beyond)
        slot_token = torch.full((w * block + n * w,), n, dtype=torch.long, device=device)  # n: the padding row
        slot_token.scatter_(0, slot.flatten(), torch.arange(n, device=device).repeat_interleave(w))
        slot_token = slot_token[:w * block]
        rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[slot_token]
        ids = torch.cat([indices, indices.new_full((1, k), NO_EXPERT)])[slot_token]
        gates = torch.cat([weights.float(), weights.new_zeros(1, k, dtype=torch.float32)])[slot_token]
        ids = self._only_peer_experts(ids, peers.repeat_interleave(block))
        record = RowRecord(x.shape[1], k, x.dtype)
        sent = record.pack(rows, ids, gates)
        overflow = None
        if header:
            overflow = needs & ~fits
            per_peer = overflow.sum(dim=0)
            counts = torch.stack([per_peer, per_peer.sum().expand(w)], dim=1).to(torch.int32)  # [W, 2]
            sent.view(w, block, -1)[:, 0, :8] = counts.view(torch.uint8)
        received = torch.empty_like(sent)
        work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
        pair_row = owner * block + header + position.gather(1, owner)
        source = torch.where(fits.gather(1, owner), pair_row * k + torch.arange(k, device=device), 0)
        self.stats.exchanges += 1
        return PendingExchange(work, sent, received, block, source, owner, overflow, x, weights, indices)

    # ------------------------------------------------------------------ combine
    def combine(self, pending: PendingExchange, expert_rows: ExpertRows) -> torch.Tensor:
        """Run this rank's experts on what it received, return the outputs; ``[n, k, D]`` per pair."""
        if pending.work is None:
            return expert_rows(pending.x, pending.indices, pending.weights.float())
        pending.work.wait()
        second_round = None
        if pending.overflow is not None:
            send, receive, everyone = self._read_overflow_counts(pending)
            second_round = (send, receive) if everyone > 0 else None
        k, d = pending.indices.shape[1], pending.x.shape[1]
        record = RowRecord(d, k, pending.x.dtype)
        outputs = expert_rows(*record.unpack(pending.received))
        returned = torch.empty_like(outputs)
        dist.all_to_all_single(_wire(returned), _wire(outputs), group=self.group)
        routed = returned.view(-1, d)[pending.source]
        if second_round is not None:
            routed = self._second_round(pending, *second_round, routed, expert_rows)
        return routed

    # ------------------------------------------------------------------ helpers
    def _exchange_size(self, n: int, device: torch.device) -> tuple[int, int]:
        """(records per peer, header records per peer) of this exchange: the same on every rank."""
        bound = self.step_tokens
        if bound is None and self.capacity is not None:
            bound = self.capacity.worst_case
        if bound is None:  # nothing known about the other ranks: agree on the largest batch now
            largest = torch.tensor([n], dtype=torch.int64, device=device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
            bound = int(largest.item())
        elif n > bound:
            raise RuntimeError(f"a rank got {n} tokens for one MoE layer, more than the {bound} announced for the "
                               f"step or allowed by the step limits (max_num_batched_tokens / max_num_seqs)")
        size = bound if self.capacity is None else min(self.capacity.tokens_per_peer, bound)
        # a rank with ``bound`` tokens may overflow only when the size is below it
        return max(1, size), int(size < bound)

    def _only_peer_experts(self, ids: torch.Tensor, peer: torch.Tensor) -> torch.Tensor:
        """``ids [R, k]`` with every id not held by the row's destination ``peer [R]`` set to NO_EXPERT."""
        held = torch.div(ids, self.slots_per_rank, rounding_mode="floor") == peer.unsqueeze(1)
        return torch.where(held, ids, NO_EXPERT)

    def _read_overflow_counts(self, pending: PendingExchange) -> tuple[list[int], list[int], int]:
        """(rows this rank sends each peer, rows it receives from each, rows all ranks send) in the
        second round: the one host read of a lowered capacity."""
        w = self.world_size
        headers = pending.received.view(w, pending.block, -1)[:, 0, :8].contiguous().view(torch.int32)
        values = torch.cat([headers.flatten().long(), pending.overflow.sum(dim=0)]).tolist()
        receive, everyone, send = values[0:2 * w:2], values[1:2 * w:2], values[2 * w:]
        return send, receive, sum(everyone)

    def _second_round(self, pending: PendingExchange, send: list[int], receive: list[int], routed: torch.Tensor,
                      expert_rows: ExpertRows) -> torch.Tensor:
        """Exchange, compute and return the rows beyond capacity (split sizes known from the headers)."""
        n, k = pending.indices.shape
        d = pending.x.shape[1]
        record = RowRecord(d, k, pending.x.dtype)
        peer, token = pending.overflow.t().nonzero(as_tuple=True)  # peer by peer, in token order
        ids = self._only_peer_experts(pending.indices[token], peer)
        sent = record.pack(pending.x[token], ids, pending.weights[token])
        received = sent.new_empty(sum(receive), record.nbytes)
        dist.all_to_all_single(received, sent, receive, send, group=self.group)
        outputs = expert_rows(*record.unpack(received))
        returned = outputs.new_empty(token.shape[0], k, d)
        dist.all_to_all_single(_wire(returned), _wire(outputs), send, receive, group=self.group)
        self.stats.second_rounds += 1
        self.stats.overflow_rows += sum(send)
        if self.stats.second_rounds == 1 or self.stats.second_rounds % 1000 == 0:
            log.warning("expert dispatch over capacity (%d exchanges of %d needed a second round; %d rows of this "
                        "rank so far): a higher capacity factor avoids the extra round", self.stats.second_rounds,
                        self.stats.exchanges, self.stats.overflow_rows)
        if token.shape[0] == 0:
            return routed
        place = torch.full((n, self.world_size), -1, dtype=torch.long, device=routed.device)
        place[token, peer] = torch.arange(token.shape[0], device=routed.device)
        row = place.gather(1, pending.owner)  # [n, k]: the pair's row in ``returned``, -1 if it fitted
        second = returned.view(-1, d)[row.clamp(min=0) * k + torch.arange(k, device=routed.device)]
        return torch.where((row >= 0).unsqueeze(-1), second, routed)
