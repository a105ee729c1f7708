"""How many token rows one rank may send another in one MoE exchange: the exchange's static size.

The expert dispatch (``expert_parallel.py``) moves a fixed number of rows between every pair of
ranks, so that its shapes never depend on the routing (no host read of split sizes, and the same
kernels and buffers every step: what a CUDA graph needs). That number is fixed once, here.

The default is the worst case: every token of the busiest step a rank can run
(``max(max_num_batched_tokens, max_num_seqs)``, prefill chunk or decode batch) routed to experts
of one single peer. It can never overflow, and it costs exchanges sized for that worst case.

``capacity_factor`` asks for less: ``factor x`` the rows one peer receives on average when routing
is uniformly random. A token goes to a given peer when at least one of its ``top_k`` distinct
experts lives there: with ``E`` experts, ``E / W`` per rank, that happens with probability
``1 - C(E - E/W, k) / C(E, k)``. Real routing is skewed, so a factor of 1 overflows often; the
rows beyond capacity are then computed in a second, dynamic round (counted, never dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def peer_share(num_experts: int, world_size: int, top_k: int) -> float:
    """Fraction of a rank's tokens that one given peer receives under uniformly random routing."""
    per_rank = num_experts // world_size
    if world_size == 1:
        return 1.0
    return 1.0 - math.comb(num_experts - per_rank, top_k) / math.comb(num_experts, top_k)


@dataclass(frozen=True)
class ExpertCapacity:
    """Token rows a rank may send each peer per MoE exchange (``tokens_per_peer``), and the most a
    rank can ever need to (``worst_case``, the largest step a rank runs)."""

    tokens_per_peer: int
    worst_case: int

    def __post_init__(self) -> None:
        if not 1 <= self.tokens_per_peer <= self.worst_case:
            raise ValueError(f"expert capacity must be in [1, {self.worst_case}] tokens per peer, "
                             f"got {self.tokens_per_peer}")

    @property
    def can_overflow(self) -> bool:
        """Below the worst case, a skewed step may not fit: then the exchange carries overflow
        counts and each layer reads them back (one small host read per MoE layer)."""
        return self.tokens_per_peer < self.worst_case

    @classmethod
    def plan(cls, max_num_seqs: int, max_num_batched_tokens: int, *, world_size: int, num_experts: int,
             top_k: int, capacity_factor: float | None = None) -> "ExpertCapacity":
        """The capacity of an engine whose ranks run at most ``max_num_seqs`` decode tokens or
        ``max_num_batched_tokens`` prefill tokens per step. ``capacity_factor`` None: the worst case."""
        worst = max(max_num_seqs, max_num_batched_tokens)
        if capacity_factor is None:
            return cls(worst, worst)
        if not capacity_factor > 0:
            raise ValueError(f"expert capacity factor must be > 0, got {capacity_factor}")
        share = peer_share(num_experts, world_size, top_k)
        return cls(min(worst, max(1, math.ceil(capacity_factor * share * worst))), worst)

    def describe(self) -> str:
        if not self.can_overflow:
            return f"{self.tokens_per_peer} tokens per peer (the worst case: never overflows)"
        return (f"{self.tokens_per_peer} tokens per peer of a worst case of {self.worst_case}: rows beyond it go "
                f"in a second, dynamic round")
