"""Which rank holds which routed experts: the placement, and the policy that balances it from loads.

Terms. A *logical* expert is one of the model's ``E`` routed experts of a layer. A *physical*
expert (a slot) is one copy of a logical expert's weights on one rank. With ``R`` redundant
experts there are ``E + R`` slots per MoE layer, ``S = (E + R) / W`` on each of the ``W`` ranks;
rank ``r`` holds slots ``r * S .. (r + 1) * S - 1`` (global slot ids), and every logical expert has
at least one slot. A placement gives, for every MoE layer, the logical expert of every slot.

The policy (``balanced_placement``) takes, per layer, how many (token, expert) routings each
logical expert received, and assumes a logical expert's tokens split evenly over its replicas
(what the dispatch's replica choice does, ``expert_load.LayerExpertMap``). Per layer:

1. **Replicate the hottest.** Every expert starts with one slot; each of the ``R`` extra slots goes
   to the expert with the highest load per replica (ties: the lowest id), never more replicas than
   ranks.
2. **Pack.** Slots, heaviest first (load / replicas; ties: lowest id), go one by one to the
   least-loaded rank that still has a free slot and does not hold that expert yet (ties: the
   lowest rank) -- greedy longest-processing-time packing with equal slot counts per rank.
3. **Never worse than the plain layout.** The plain layout (slot ``i < E`` holds expert ``i``: with
   ``R = 0`` the contiguous placement; the copies packed into the extra slots as in step 2) is
   estimated too, and the packing is kept only if its busiest rank carries less.
4. **Move little.** Given the placement in use (a rebalance while serving), two candidates: the
   packing of steps 1-3 with its groups matched to the ranks that already hold most of their
   experts (an expert already in a rank's slot keeps that slot), and the placement in use improved
   by a few swaps between the busiest rank and the least-loaded ones (the copies unchanged). The
   swaps win when their busiest rank is within ``REFINE_TOLERANCE`` of the packing's: a small
   drift of the loads then moves a few experts, not most of them.

The estimated load of a rank is the sum of its slots' shares; a layer's imbalance is its busiest
rank's load over the mean rank load, and a model's (``imbalance``) is the sum over layers of the
busiest rank's load over the sum of the means: the MoE time under this placement relative to a
perfect balance, if a layer's time follows its busiest rank. See docs/expert-load-balance.md.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

# a rebalance keeps the copies where they are and only swaps a few experts when that comes within
# this share of a fresh packing's busiest rank (much less traffic for nearly as good a balance)
REFINE_TOLERANCE = 0.02
REFINE_CANDIDATES = 4  # least-loaded ranks tried as swap partners of the busiest


@dataclass(frozen=True)
class ExpertPlacement:
    """The logical expert of every slot of every MoE layer: ``layers[l][slot]``."""

    num_experts: int  # logical experts per layer
    world_size: int
    layers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_experts < 1:
            raise ValueError("a placement needs at least one rank and one expert")
        for layer, slots in enumerate(self.layers):
            if len(slots) != self.num_slots:
                raise ValueError(f"layer {layer}: {len(slots)} slots, expected {self.num_slots}")
            if sorted(set(slots)) != list(range(self.num_experts)):
                raise ValueError(f"layer {layer}: every expert 0..{self.num_experts - 1} needs a slot, and only those")

    @property
    def num_slots(self) -> int:
        """Physical experts per layer (the same for every layer)."""
        return len(self.layers[0]) if self.layers else self.num_experts

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.world_size

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, world_size: int) -> "ExpertPlacement":
        """Rank ``r`` holds experts ``r * E/W .. (r + 1) * E/W - 1`` of every layer, no replica."""
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks")
        return cls(num_experts, world_size, (tuple(range(num_experts)),) * num_layers)

    def rank_experts(self, layer: int, rank: int) -> tuple[int, ...]:
        """The logical expert of each slot rank ``rank`` holds in ``layer``, in slot order."""
        s = self.slots_per_rank
        return self.layers[layer][rank * s:(rank + 1) * s]

    def replicas(self, layer: int) -> list[list[int]]:
        """For every logical expert of ``layer``, its slots (global ids, increasing)."""
        found: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.layers[layer]):
            found[expert].append(slot)
        return found

    def is_contiguous(self) -> bool:
        return self.num_redundant == 0 and all(slots == tuple(range(self.num_experts)) for slots in self.layers)

    def rank_loads(self, layer: int, expert_loads: Sequence[float]) -> list[float]:
        """Estimated load of each rank in ``layer``: each expert's load split evenly over its replicas."""
        return _rank_loads(self.layers[layer], expert_loads, self.world_size)

    def imbalance(self, loads: Sequence[Sequence[float]]) -> float:
        """Sum over layers of the busiest rank's estimated load / sum of the mean rank loads (1: perfect)."""
        busiest = mean = 0.0
        for layer, expert_loads in enumerate(loads):
            ranks = self.rank_loads(layer, expert_loads)
            busiest += max(ranks)
            mean += sum(ranks) / len(ranks)
        return busiest / mean if mean > 0 else 1.0


def check_placement_size(num_experts: int, world_size: int, num_redundant: int) -> None:
    """Raise ValueError unless ``E + R`` slots split evenly over the ranks and replicas fit (at most
    one copy of an expert per rank)."""
    if num_redundant < 0:
        raise ValueError(f"redundant experts must be >= 0, got {num_redundant}")
    if (num_experts + num_redundant) % world_size:
        raise ValueError(f"{num_experts} experts + {num_redundant} redundant cannot be split evenly over "
                         f"{world_size} ranks")
    if num_redundant > num_experts * (world_size - 1):
        raise ValueError(f"{num_redundant} redundant experts is more than one copy of each of the {num_experts} "
                         f"experts on each of the {world_size} ranks")


def balanced_placement(loads: Sequence[Sequence[float]], world_size: int, num_redundant: int,
                       previous: ExpertPlacement | None = None) -> ExpertPlacement:
    """The placement of ``loads[layer][expert]`` (routings counted per logical expert) over
    ``world_size`` ranks with ``num_redundant`` extra slots per layer. Deterministic: the same
    loads give the same placement on every rank. ``previous``: the placement in use, to move
    as few experts as possible (same sizes required)."""
    num_experts = len(loads[0]) if loads else 0
    check_placement_size(num_experts, world_size, num_redundant)
    if previous is not None and (previous.num_experts, previous.world_size, previous.num_slots,
                                 previous.num_layers) != (num_experts, world_size, num_experts + num_redundant,
                                                          len(loads)):
        raise ValueError("the previous placement has other sizes than the one asked for")
    layers = []
    for layer, expert_loads in enumerate(loads):
        if len(expert_loads) != num_experts:
            raise ValueError(f"layer {layer} has {len(expert_loads)} expert loads, layer 0 has {num_experts}")
        layers.append(balance_layer([float(v) for v in expert_loads], world_size, num_redundant,
                                    previous.layers[layer] if previous is not None else None))
    return ExpertPlacement(num_experts, world_size, tuple(layers))


def balance_layer(loads: list[float], world_size: int, num_redundant: int,
                  previous: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """One layer's slots (logical expert per global slot); see the module's steps 1-4."""
    counts = replica_counts(loads, num_redundant, world_size)
    per_rank = (len(loads) + num_redundant) // world_size
    packed = _pack(loads, counts, world_size, per_rank)
    plain = _plain_layout(loads, counts, world_size, per_rank)
    if max(_rank_loads(_flatten(plain), loads, world_size)) <= max(_rank_loads(_flatten(packed), loads, world_size)):
        packed = plain
    if previous is None:
        return _flatten(packed)
    fresh = _follow(packed, previous, world_size, per_rank)
    refined = _refine(previous, loads, world_size, per_rank)
    if max(_rank_loads(_flatten(refined), loads, world_size)) <= \
            (1.0 + REFINE_TOLERANCE) * max(_rank_loads(_flatten(fresh), loads, world_size)):
        return _flatten(refined)
    return _flatten(fresh)


def replica_counts(loads: Sequence[float], num_redundant: int, world_size: int) -> list[int]:
    """Copies of each expert: one each, and every extra one to the highest load per copy."""
    counts = [1] * len(loads)
    heap = [(-load, expert) for expert, load in enumerate(loads)]  # (-load per copy, expert)
    heapq.heapify(heap)
    for _ in range(num_redundant):
        while True:
            _, expert = heapq.heappop(heap)
            if counts[expert] < world_size:  # an expert on every rank takes no more copies
                break
        counts[expert] += 1
        if counts[expert] < world_size:
            heapq.heappush(heap, (-loads[expert] / counts[expert], expert))
    return counts


def _refine(previous: Sequence[int], loads: Sequence[float], world_size: int, per_rank: int) -> list[list[int]]:
    """The previous layout (its copies as they are) improved by swaps: while some swap of a slot of
    the busiest rank with a slot of one of the ``REFINE_CANDIDATES`` least-loaded ranks lowers the
    larger of the two loads below the busiest one, make the best such swap (at most ``world_size``
    swaps: two experts move per swap)."""
    groups = [list(previous[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
    copies = [0] * len(loads)
    for expert in previous:
        copies[expert] += 1
    share = [loads[e] / copies[e] for e in range(len(loads))]
    rank_load = [sum(share[e] for e in group) for group in groups]
    for _ in range(world_size):
        busiest = max(range(world_size), key=lambda r: (rank_load[r], -r))
        lightest = sorted((r for r in range(world_size) if r != busiest), key=lambda r: (rank_load[r], r))
        best = None  # (the larger load after the swap, rank, slot on the busiest, slot on the rank)
        on_busiest = set(groups[busiest])
        for rank in lightest[:REFINE_CANDIDATES]:
            # the best partner of a hot slot has the share closest to share[hot] - gap / 2 (the
            # larger load after the swap grows with the distance): search the sorted shares
            gap = rank_load[busiest] - rank_load[rank]
            colds = sorted((share[cold], j) for j, cold in enumerate(groups[rank]))
            keys = [value for value, _ in colds]
            on_rank = set(groups[rank])
            for i, hot in enumerate(groups[busiest]):
                if hot in on_rank:
                    continue
                position = bisect.bisect_left(keys, share[hot] - gap / 2)
                for step in (-1, 1):  # the nearest usable partner below the ideal share, and above it
                    c = position - 1 if step < 0 else position
                    while 0 <= c < len(colds) and (keys[c] >= share[hot]
                                                   or groups[rank][colds[c][1]] in on_busiest):
                        c += step
                    if not 0 <= c < len(colds):
                        continue
                    moved = share[hot] - keys[c]
                    worst = max(rank_load[busiest] - moved, rank_load[rank] + moved)
                    if worst < rank_load[busiest] and (best is None or worst < best[0]):
                        best = (worst, rank, i, colds[c][1])
        if best is None:
            break
        _, rank, i, j = best
        hot, cold = groups[busiest][i], groups[rank][j]
        groups[busiest][i], groups[rank][j] = cold, hot
        rank_load[busiest] += share[cold] - share[hot]
        rank_load[rank] += share[hot] - share[cold]
    return groups


def _pack(loads: Sequence[float], counts: list[int], world_size: int, per_rank: int,
          groups: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy packing of the slots, heaviest first, onto the least-loaded rank with room; ``groups``:
    slots already filled (their copies are not packed again)."""
    groups = [list(g) for g in groups] if groups is not None else [[] for _ in range(world_size)]
    shares = [loads[e] / counts[e] for e in range(len(loads))]
    placed = [0] * len(loads)
    for group in groups:
        for expert in group:
            placed[expert] += 1
    items = sorted(((shares[e], e) for e in range(len(loads)) for _ in range(counts[e] - placed[e])),
                   key=lambda item: (-item[0], item[1]))
    open_ranks = [(sum(shares[e] for e in g), r) for r, g in enumerate(groups) if len(g) < per_rank]
    heapq.heapify(open_ranks)  # (load, rank) of the ranks with a free slot
    for share, expert in items:
        skipped = []
        while True:
            load, rank = heapq.heappop(open_ranks)
            if expert not in groups[rank] or not open_ranks:
                break
            skipped.append((load, rank))
        if expert in groups[rank]:  # every open rank holds it already: a second copy on one rank
            skipped.append((load, rank))
            load, rank = min(skipped)
            skipped.remove((load, rank))
        groups[rank].append(expert)
        if len(groups[rank]) < per_rank:
            heapq.heappush(open_ranks, (load + share, rank))
        for entry in skipped:
            heapq.heappush(open_ranks, entry)
    return groups


def _plain_layout(loads: Sequence[float], counts: list[int], world_size: int, per_rank: int) -> list[list[int]]:
    """Slot ``i < E`` holds expert ``i`` (with no copies: the contiguous placement); the extra
    slots take the copies, packed like ``_pack`` does."""
    base = [list(range(r * per_rank, min((r + 1) * per_rank, len(loads)))) for r in range(world_size)]
    return _pack(loads, counts, world_size, per_rank, base)


def _follow(groups: list[list[int]], previous: tuple[int, ...], world_size: int, per_rank: int) -> list[list[int]]:
    """The groups given to the ranks that hold most of their experts already, each expert kept in
    the slot it had on that rank."""
    held = [list(previous[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
    holders: dict[int, list[int]] = {}
    for r, experts in enumerate(held):
        for expert in set(experts):
            holders.setdefault(expert, []).append(r)
    overlap: dict[tuple[int, int], int] = {}  # (group, rank) -> experts of the group the rank holds
    for g, group in enumerate(groups):
        for expert in set(group):
            for r in holders.get(expert, ()):
                overlap[(g, r)] = overlap.get((g, r), 0) + min(group.count(expert), held[r].count(expert))
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, g, r in sorted((-count, g, r) for (g, r), count in overlap.items()):
        if g not in rank_of and r not in taken:
            rank_of[g] = r
            taken.add(r)
    free_ranks = iter(r for r in range(world_size) if r not in taken)
    for g in range(len(groups)):
        if g not in rank_of:
            rank_of[g] = next(free_ranks)
    ordered: list[list[int]] = [[] for _ in range(world_size)]
    for g, group in enumerate(groups):
        r = rank_of[g]
        before = held[r]
        slots: list[int | None] = [None] * per_rank
        rest = []
        for expert in sorted(group):
            position = next((i for i, e in enumerate(before) if e == expert and slots[i] is None), None)
            if position is None:
                rest.append(expert)
            else:
                slots[position] = expert
        free = iter(i for i, e in enumerate(slots) if e is None)
        for expert in rest:
            slots[next(free)] = expert
        ordered[r] = slots
    return ordered


def _rank_loads(slots: Sequence[int], loads: Sequence[float], world_size: int) -> list[float]:
    copies = [0] * len(loads)
    for expert in slots:
        copies[expert] += 1
    per_rank = len(slots) // world_size
    return [sum(loads[e] / copies[e] for e in slots[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]


def _flatten(groups: list[list[int]]) -> tuple[int, ...]:
    return tuple(e for group in groups for e in group)
