"""Expert load on the device: each MoE layer's routing map (logical expert -> one of its physical
copies) and the counters the load balancer and ``/metrics`` read.

Per rank, two counters live on the device and only grow (no host read per step), both counted
where the router ran, each (token, expert) pair once:

* ``routed [layers, experts]``: this rank's pairs per logical expert (what the placement policy and
  the statistics file need);
* ``slots [layers, slots]``: the same pairs per slot they were sent to. Summed over the ranks and
  over each rank's slots, they are the pairs each rank's experts computed: its real share of the
  MoE work, whichever rank routed the tokens.

Every ``REPORT_EVERY_STEPS`` steps the worker copies both to pinned host memory without waiting
(the copy is queued behind the step's work) and sends them with that step's results, once the
step's own device-to-host wait has passed (``ExpertLoadReport``). The engine core turns them into
the imbalance gauge and the statistics file.

Replica choice: a token's pair (token ``t``, expert ``e``) goes to copy ``(t + rank) mod c_e`` of
``e``'s ``c_e`` copies (in increasing slot id). Consecutive tokens of a rank alternate over the
copies and ranks start at different copies, so each copy gets about ``1 / c_e`` of the expert's
tokens, what the placement policy assumes. Any choice gives the same outputs: copies hold the same
bytes and the combine sums in logical expert order (``model.moe.combine_routed``).
"""

from __future__ import annotations

import torch

from engine_core.protocol import ExpertLoadReport

from .expert_placement import ExpertPlacement

ALL_ROWS = 2**62
REPORT_EVERY_STEPS = 16  # steps between two load reports of a worker (steps whose id is a multiple)
KEPT_SNAPSHOTS = 4  # snapshots of steps whose results were never collected are dropped beyond this


class LayerExpertMap:
    """One MoE layer's routing map on one rank, and its rows of the load counters.

    ``table[e, j]``: the global slot id of copy ``j`` of logical expert ``e`` (unused entries repeat
    the first copy), ``copies[e]``: how many there are. Both are updated in place by a rebalance,
    so their addresses never change. ``static``: the placement never changes (no rebalancing):
    an identity placement then skips the mapping altogether."""

    def __init__(self, placement: ExpertPlacement, layer: int, rank: int, routed: torch.Tensor,
                 slots: torch.Tensor, static: bool, counted_rows: torch.Tensor | None = None):
        self.layer, self.rank, self.static = layer, rank, static
        self.routed, self.slots = routed, slots  # views into ExpertLoadRecorder's counters
        self.counted_rows = counted_rows  # ExpertLoadRecorder.counted_rows (None: every row counts)
        device = routed.device
        # R redundant slots give an expert at most R + 1 copies, whatever the placement
        self.table = torch.zeros(placement.num_experts, placement.num_redundant + 1, dtype=torch.long, device=device)
        self.copies = torch.ones(placement.num_experts, dtype=torch.long, device=device)
        self.identity = False
        self.load(placement)

    def load(self, placement: ExpertPlacement) -> None:
        """Take ``placement``'s copies of this layer (in place)."""
        replicas = placement.replicas(self.layer)
        width = self.table.shape[1]
        rows = [(slots + [slots[0]] * width)[:width] for slots in replicas]
        self.table.copy_(torch.tensor(rows, dtype=torch.long))
        self.copies.copy_(torch.tensor([len(slots) for slots in replicas], dtype=torch.long))
        self.identity = self.static and placement.layers[self.layer] == tuple(range(placement.num_experts))

    def route(self, indices: torch.Tensor) -> torch.Tensor:
        """Count the routing ``indices [n, k]`` (logical ids) and return the slot of each pair."""
        flat = indices.reshape(-1)
        if self.counted_rows is None:
            ones = torch.ones_like(flat)
        else:  # padding rows count 0
            rows = torch.arange(indices.shape[0], device=indices.device)
            ones = (rows < self.counted_rows).long().unsqueeze(1).expand_as(indices).reshape(-1)
        self.routed.index_add_(0, flat, ones)
        if self.identity:
            self.slots.index_add_(0, flat, ones)
            return indices
        token = torch.arange(indices.shape[0], device=indices.device).unsqueeze(1) + self.rank
        slots = self.table[indices, token % self.copies[indices]]
        self.slots.index_add_(0, slots.reshape(-1), ones)
        return slots


class ExpertLoadRecorder:
    """The counters of one rank (``routed [L, E]``, ``slots [L, P]``) and their reports."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device):
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.device = torch.device(device)
        self.routed = torch.zeros(num_layers, num_experts, dtype=torch.long, device=self.device)
        self.slots = torch.zeros(num_layers, num_slots, dtype=torch.long, device=self.device)
        # token rows of a forward that are real: a CUDA-graph batch ends in padding rows, which
        # route somewhere too but are no load (a device value, so that a graph reads it)
        self.counted_rows = torch.full((), ALL_ROWS, dtype=torch.long, device=self.device)
        self._snapshots: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def reset(self) -> None:
        self.routed.zero_()
        self.slots.zero_()

    def snapshot(self, step_id: int) -> None:
        """Queue a copy of the counters as they will be after what is queued now (no wait)."""
        values = torch.cat([self.routed.flatten(), self.slots.flatten()])
        if self.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = values, None
        self._snapshots[step_id] = (host, event)
        while len(self._snapshots) > KEPT_SNAPSHOTS:
            del self._snapshots[min(self._snapshots)]

    def report(self, step_id: int, rebalances: int) -> ExpertLoadReport | None:
        """The report of step ``step_id``'s snapshot, if it took one."""
        taken = self._snapshots.pop(step_id, None)
        if taken is None:
            return None
        host, event = taken
        if event is not None:
            event.synchronize()
        values = host.numpy().astype("<i8", copy=False)
        cut = self.num_layers * self.num_experts
        return ExpertLoadReport(self.num_layers, self.num_experts, self.num_slots, values[:cut].tobytes(),
                                values[cut:].tobytes(), rebalances)
