"""One rank of the expert-placement tests (``test_eplb_dispatch.py``), run in its own process.

Each rank joins a gloo group and, for every scenario, loads the tiny checkpoint's experts of its
slots under a placement (redundant copies, a placement from skewed loads, a lowered capacity),
installs the expert maps (``ExpertLoadBalancer``) and runs the scenario's inputs through two MoE
layers with an ``ExpertParallelDispatcher``. The rebalance scenario first routes hot tokens, then
rebalances (the weights move between the ranks) and runs the inputs on the new placement. Each
rank saves its outputs, counters, placement and expert stacks for the test process to compare
with one rank holding every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from expert_dispatch_ranks import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, join_gloo_group, with_hot_bias

LAYERS = (0, 3)


@dataclass(frozen=True)
class PlacementScenario:
    name: str
    tokens: tuple[int, ...]  # tokens per rank (cycled over the ranks)
    redundant_per_rank: int  # redundant experts = this x world size
    loads: str  # the placement's loads: "uniform", "skewed" or "hot" (the hot experts' loads high)
    hot: tuple[int, ...] = ()  # experts every token is routed to (router bias), in the inputs' forwards
    capacity: int | None = None  # tokens per peer (None: the worst case)
    rebalance: bool = False  # route hot tokens, rebalance, then run the inputs


SCENARIOS = (
    PlacementScenario("redundant_skewed", (13, 29, 0, 5), 1, "skewed"),
    PlacementScenario("permuted_no_copies", (13, 29, 0, 5), 0, "skewed"),
    PlacementScenario("redundant_hot", (32, 17, 1, 0), 1, "hot", hot=(0, 1)),
    PlacementScenario("redundant_overflow", (13, 29, 0, 5), 1, "skewed", capacity=3),
    PlacementScenario("rebalance", (13, 29, 0, 5), 1, "uniform", hot=(3,), rebalance=True),
)


def tokens_of(scenario: PlacementScenario, rank: int) -> int:
    return scenario.tokens[rank % len(scenario.tokens)]


def inputs(scenario: PlacementScenario, rank: int, layer: int, dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5000 + 1000 * SCENARIOS.index(scenario) + 10 * rank + layer)
    return torch.randn(tokens_of(scenario, rank), dim, generator=gen).to(torch.bfloat16)


def placement_of(scenario: PlacementScenario, world_size: int, num_layers: int, num_experts: int):
    """The same placement on every rank (a pure function of the scenario)."""
    from workers.expert_placement import balanced_placement

    if scenario.loads == "uniform":
        loads = [[1] * num_experts for _ in range(num_layers)]
    elif scenario.loads == "hot":
        loads = [[1000 if e in scenario.hot else 1 for e in range(num_experts)] for _ in range(num_layers)]
    else:  # a different skew per layer: the last expert of layer 0 is the hottest, and so on
        loads = [[(1 + (e + layer) % num_experts) ** 3 for e in range(num_experts)] for layer in range(num_layers)]
    return balanced_placement(loads, world_size, scenario.redundant_per_rank * world_size)


def rank_main(rank: int, world_size: int, checkpoint: str, store_path: str, out_dir: str) -> None:
    from model.config import V41Config
    from model.loader import load_model
    from workers.expert_balancer import ExpertLoadBalancer
    from workers.expert_capacity import ExpertCapacity
    from workers.expert_parallel import ExpertParallelDispatcher
    from workers.expert_weight_moves import expert_tensors

    join_gloo_group(rank, world_size, store_path)
    try:
        cfg = V41Config.from_pretrained(checkpoint)
        results = {}
        for scenario in SCENARIOS:
            placement = placement_of(scenario, world_size, cfg.num_layers, cfg.num_routed_experts)
            worst = max(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
            capacity = ExpertCapacity(scenario.capacity or worst, worst)
            dispatcher = ExpertParallelDispatcher(rank, world_size, cfg.num_routed_experts, capacity=capacity,
                                                  placement=placement)
            model = load_model(checkpoint, expert_range=dispatcher.expert_shard())
            balancer = ExpertLoadBalancer(model, dispatcher, placement, rank, step_interval=1)
            dispatcher.set_step_tokens(max(tokens_of(scenario, r) for r in range(world_size)))
            changed = None
            if scenario.rebalance:
                for layer in LAYERS:  # the warm-up: hot tokens counted where they are routed
                    moe = model.blocks[layer].moe
                    bias = with_hot_bias(moe, scenario.hot)
                    moe(inputs(scenario, rank, layer, cfg.hidden_size))
                    moe.router.bias = bias
                changed = balancer.rebalance()
                balancer.recorder.reset()
            outputs = {}
            for layer in LAYERS:
                moe = model.blocks[layer].moe
                bias = with_hot_bias(moe, scenario.hot if not scenario.rebalance else ())
                outputs[layer] = moe(inputs(scenario, rank, layer, cfg.hidden_size))
                moe.router.bias = bias
            results[scenario.name] = dict(
                outputs=outputs, changed=changed, placement=balancer.placement.layers,
                window=balancer.window_start.clone(),  # this rank's routings the rebalance summed
                routed=balancer.recorder.routed.clone(), slots=balancer.recorder.slots.clone(),
                second_rounds=dispatcher.stats.second_rounds,
                experts={layer: [t.clone() for t in expert_tensors(model.blocks[layer].moe.experts)]
                         for layer in LAYERS})
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
