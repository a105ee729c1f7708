"""One startup line per worker: what this rank holds and what memory it took.

    rank 1 of 2: routed experts 2-3 of 4 in every MoE layer (no redundant copy); Engram tables 1.3 MiB
    in device memory; weights 12.0 MiB; caches 3.4 MiB (256 KV blocks, 8 state slots)

With a placement from loads or redundant experts the expert part says how many slots the rank holds
per layer, how many copies the placement has in all, and which experts the first layer holds.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

LISTED_EXPERTS = 16  # a layer's expert ids are listed up to this many slots


def describe_experts(placement, rank: int, num_experts: int, world_size: int) -> str:
    """The expert part of the line, for a placement (None: every expert on this one rank)."""
    if placement is None:
        return f"all {num_experts} routed experts"
    slots = placement.slots_per_rank
    if placement.is_contiguous():
        first = rank * slots
        return f"routed experts {first}-{first + slots - 1} of {num_experts} in every MoE layer (no redundant copy)"
    held = placement.rank_experts(0, rank)
    listed = f"layer 0: {', '.join(map(str, held))}" if slots <= LISTED_EXPERTS else \
        f"layer 0: {len(set(held))} distinct experts"
    return (f"{slots} expert slots per MoE layer ({listed}) of {placement.num_slots} over {world_size} ranks: "
            f"{num_experts} experts + {placement.num_redundant} redundant copies")


def rank_summary(runner) -> str:
    """The line of a ``ModelRunner`` (after its caches are allocated)."""
    from model.cache import bytes_per_block, bytes_per_slot
    from model.loader import held_weight_bytes

    model, cap, cfg = runner.model, runner.capacity, runner.cfg
    dispatcher = runner.expert_parallel
    world = dispatcher.world_size if dispatcher is not None else 1
    placement = dispatcher.placement if dispatcher is not None else None
    if dispatcher is not None and placement is None:  # a dispatcher given its range only
        from .expert_placement import ExpertPlacement

        placement = ExpertPlacement.contiguous(cfg.num_layers, cfg.num_routed_experts, world)
    parts = [describe_experts(placement, runner.rank, cfg.num_routed_experts, world)]
    engrams = [block.engram for block in model.blocks if block.engram is not None]
    if engrams:
        table_bytes = sum(e.table.nbytes + (e.table_scale.nbytes if e.table_scale is not None else 0)
                          for e in engrams)
        where = "pinned host memory" if any(e.host_mapped for e in engrams) else "device memory"
        parts.append(f"Engram tables {_size(table_bytes)} in {where}")
    parts.append(f"weights {_size(held_weight_bytes(model))}")
    cache_bytes = cap.num_blocks * bytes_per_block(cfg, cap.block_size) + cap.num_slots * bytes_per_slot(cfg)
    parts.append(f"caches {_size(cache_bytes)} ({cap.num_blocks - 1} KV blocks, {cap.num_slots} state slots)")
    return f"rank {runner.rank} of {world}: " + "; ".join(parts)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def log_rank_summary(runner) -> None:
    log.info("%s", rank_summary(runner))
