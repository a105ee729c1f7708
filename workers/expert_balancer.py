"""A worker's expert load balancing (EPLB): the placement at startup, the load counters, the load
reports, and the rebalance while serving. The policy is ``expert_placement.py``; the flags and the
file are described in docs/expert-load-balance.md.

* Startup (``startup_placement``, before the weights are loaded): with ``--eplb-stats-file`` naming
  a file that exists, the experts are placed by its loads (``balanced_placement``); otherwise, with
  ``--num-redundant-experts`` R > 0, by uniform loads (copies of the first R experts, packed
  evenly); otherwise contiguously. Rank 0 reads the file and sends its counts to the others, so
  every rank computes the same placement even if the nodes' copies of the file differ.
* Serving: each MoE layer gets its expert map (``expert_load.LayerExpertMap``): slot choice and
  counters. Every ``REPORT_EVERY_STEPS`` steps the counters go to the engine core with the step's
  results (the imbalance gauge, the statistics file).
* Rebalance (``--eplb-step-interval N``, N > 0): before every step whose id is a multiple of N, all
  ranks sum the loads counted since the previous rebalance (one all-reduce and one host read),
  compute the same new placement, keep the old one for every layer where it would not lower the
  busiest rank's estimated load by ``MIN_GAIN``, and move the weights of the layers that change
  (``expert_weight_moves.py``) in place. The service never stops: this happens between two steps,
  on every rank, like any step's collectives.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .expert_load import ALL_ROWS, REPORT_EVERY_STEPS, ExpertLoadRecorder, LayerExpertMap
from .expert_load_file import ExpertLoadCounts, ExpertLoadFileError, read_expert_load
from .expert_placement import ExpertPlacement, balanced_placement
from .expert_weight_moves import apply_moves, plan_moves

log = logging.getLogger(__name__)

MIN_GAIN = 0.05  # a layer moves only if its busiest rank's estimated load drops by this fraction


def startup_placement(config, cfg, rank: int = 0) -> ExpertPlacement:
    """The placement an engine starts with (``config``: ``EngineConfig``, ``cfg``: ``V41Config``).
    Under torch.distributed, rank 0 alone reads the statistics file and sends its counts to the
    others (a collective: every rank calls this), so every rank places from the same counts even
    when the nodes' copies of the file differ."""
    layers, experts, world = cfg.num_layers, cfg.num_routed_experts, config.dp_size
    redundant = config.num_redundant_experts
    counts = _shared_counts(config.eplb_stats_file, layers, experts, rank) if config.eplb_stats_file else None
    if counts is not None and counts.total > 0:
        placement = balanced_placement(counts.tokens, world, redundant)
        if rank == 0:
            contiguous = ExpertPlacement.contiguous(layers, experts, world) if experts % world == 0 else None
            baseline = f", contiguous {contiguous.imbalance(counts.tokens):.3f}" if contiguous is not None else ""
            log.info("expert placement from %s (%d routed tokens): estimated imbalance %.3f%s", config.eplb_stats_file,
                     counts.total, placement.imbalance(counts.tokens), baseline)
        return placement
    if config.eplb_stats_file and rank == 0:
        log.info("expert placement: no loads in %s yet (it is written at shutdown)", config.eplb_stats_file)
    if redundant:
        return balanced_placement([[1] * experts] * layers, world, redundant)
    return ExpertPlacement.contiguous(layers, experts, world)


def _shared_counts(path: str, num_layers: int, num_experts: int, rank: int) -> ExpertLoadCounts | None:
    """The counts of ``path`` as rank 0 reads them, on every rank of the default group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return read_expert_load(path, num_layers, num_experts)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    status = torch.zeros(1, dtype=torch.long, device=device)  # 1: counts follow, 0: no file, -1: unreadable
    counts, error = None, None
    if rank == 0:
        try:
            counts = read_expert_load(path, num_layers, num_experts)
        except ExpertLoadFileError as exc:
            error = exc
        status.fill_(-1 if error is not None else int(counts is not None))
    dist.broadcast(status, src=0)
    if status.item() == -1:
        raise error if error is not None else ExpertLoadFileError(f"rank 0 could not read {path}: see its log")
    if status.item() == 0:
        return None
    values = torch.tensor(counts.tokens, dtype=torch.long, device=device) if rank == 0 else \
        torch.empty(num_layers, num_experts, dtype=torch.long, device=device)
    dist.broadcast(values, src=0)
    return ExpertLoadCounts(tuple(tuple(row) for row in values.tolist()))


class ExpertLoadBalancer:
    """The expert maps of a model's MoE layers, their counters, and the rebalance of one rank."""

    def __init__(self, model, dispatcher, placement: ExpertPlacement, rank: int, step_interval: int | None):
        self.model, self.dispatcher, self.placement = model, dispatcher, placement
        self.rank, self.step_interval = rank, step_interval or None
        self.group = dispatcher.group if dispatcher is not None else None
        device = model.embed.device
        self.recorder = ExpertLoadRecorder(placement.num_layers, placement.num_experts, placement.num_slots, device)
        self.maps = [LayerExpertMap(placement, layer, rank, self.recorder.routed[layer], self.recorder.slots[layer],
                                    static=self.step_interval is None, counted_rows=self.recorder.counted_rows)
                     for layer in range(placement.num_layers)]
        self._counted_rows: int | None = None
        for block, expert_map in zip(model.blocks, self.maps):
            block.moe.dispatcher, block.moe.expert_map = dispatcher, expert_map
        self.window_start = torch.zeros_like(self.recorder.routed)  # routed counts at the last rebalance
        self.rebalances = 0
        self._counting = False

    @classmethod
    def attach(cls, model, dispatcher, config) -> "ExpertLoadBalancer | None":
        """Give every MoE layer of ``model`` its dispatcher and expert map. None when nothing is to be
        balanced or recorded (one rank and no statistics file): the layers then count nothing."""
        for block in model.blocks:
            block.moe.dispatcher = dispatcher
        if dispatcher is None and not config.eplb_stats_file:
            return None
        if dispatcher is not None and dispatcher.placement is not None:
            placement, rank = dispatcher.placement, dispatcher.rank
        else:
            cfg = model.cfg
            world = dispatcher.world_size if dispatcher is not None else 1
            placement = ExpertPlacement.contiguous(cfg.num_layers, cfg.num_routed_experts, world)
            rank = dispatcher.rank if dispatcher is not None else 0
        interval = config.eplb_step_interval if dispatcher is not None and dispatcher.world_size > 1 else None
        return cls(model, dispatcher, placement, rank, interval)

    def count_rows(self, rows: int | None) -> None:
        """Count only the first ``rows`` token rows of the next forwards (None: all of them)."""
        if rows != self._counted_rows:
            self.recorder.counted_rows.fill_(ALL_ROWS if rows is None else rows)
            self._counted_rows = rows

    # ------------------------------------------------------------------ every step
    def before_step(self, step_id: int) -> None:
        """Between steps, on every rank with the same ``step_id``: rebalance when due, and queue the
        counters' copy of a reporting step."""
        if not self._counting:  # what ran before the first step (a memory-profiling forward) is no load
            self.recorder.reset()
            self._counting = True
        if self.step_interval and step_id > 0 and step_id % self.step_interval == 0:
            self.rebalance()
        if step_id % REPORT_EVERY_STEPS == 0:
            self.recorder.snapshot(step_id)

    def report(self, step_id: int):
        """The ``ExpertLoadReport`` to send with step ``step_id``'s results, or None."""
        return self.recorder.report(step_id, self.rebalances)

    # ------------------------------------------------------------------ rebalance
    def rebalance(self) -> bool:
        """Agree on a placement from the loads since the last rebalance and move the weights
        (collective: every rank calls it at the same step). True when the placement changed."""
        window = self.recorder.routed - self.window_start
        self.window_start.copy_(self.recorder.routed)
        if self.placement.world_size > 1:
            dist.all_reduce(window, group=self.group)
        loads = window.tolist()
        if not any(any(row) for row in loads):
            return False
        current = self.placement
        proposed = balanced_placement(loads, current.world_size, current.num_redundant, previous=current)
        layers = []
        for layer, expert_loads in enumerate(loads):
            now = max(current.rank_loads(layer, expert_loads))
            better = max(proposed.rank_loads(layer, expert_loads))
            layers.append(proposed.layers[layer] if better < (1.0 - MIN_GAIN) * now else current.layers[layer])
        new = ExpertPlacement(current.num_experts, current.world_size, tuple(layers))
        if new == current:
            return False
        rewritten = 0
        for layer, block in enumerate(self.model.blocks):
            if new.layers[layer] != current.layers[layer]:
                moves = plan_moves(current.layers[layer], new.layers[layer], current.world_size)
                rewritten += apply_moves(block.moe.experts, moves, self.rank, current.world_size, self.group)
                self.maps[layer].load(new)
        self.placement = new
        if self.dispatcher is not None:
            self.dispatcher.placement = new
        self.rebalances += 1
        changed = sum(a != b for a, b in zip(new.layers, current.layers))
        log.info("expert rebalance %d: %d of %d layers moved (%d slots of this rank rewritten); estimated "
                 "imbalance %.3f -> %.3f", self.rebalances, changed, new.num_layers, rewritten,
                 current.imbalance(loads), new.imbalance(loads))
        return True
