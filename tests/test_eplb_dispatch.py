"""Expert placements with redundant copies over real gloo processes equal one rank holding every
expert, bit for bit, and a rebalance moves the right weights.

``eplb_ranks.py`` runs each rank (its own process, the experts of its slots under the scenario's
placement, a real gloo group); this module recomputes every rank's inputs with a single rank
holding all experts and no dispatcher, and requires identical outputs. Scenarios: redundant copies
placed from skewed loads; a non-contiguous placement without copies; every token routed to two
replicated hot experts (the copies share the work); a lowered capacity (rows overflow into the
second round with slot ids); a rebalance while "serving": tokens that all pick one hot expert are
counted, the ranks agree on a new placement and move the weights, then the inputs run on it. World
sizes 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
from eplb_ranks import LAYERS, SCENARIOS, inputs, placement_of, rank_main, tokens_of
from expert_dispatch_ranks import assert_single_rank_output, run_rank_processes

from model.loader import load_model
from workers.expert_balancer import MIN_GAIN
from workers.expert_placement import ExpertPlacement
from workers.expert_weight_moves import expert_tensors


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, tiny_checkpoint, tmp_path_factory):
    world_size = request.param
    directory = tmp_path_factory.mktemp(f"eplb{world_size}")
    return world_size, run_rank_processes(rank_main, world_size, str(tiny_checkpoint), directory)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_placed_dispatch_equals_single_rank(ranks, single_rank, scenario):
    world_size, results = ranks
    cfg = single_rank.cfg
    placement = ExpertPlacement(cfg.num_routed_experts, world_size, results[0][scenario.name]["placement"])
    assert placement.num_redundant == scenario.redundant_per_rank * world_size
    if placement.slots_per_rank > 1:  # (one expert per rank, no copies: every layout balances the same)
        assert not placement.is_contiguous()
    for rank, result in enumerate(results):
        assert result[scenario.name]["placement"] == placement.layers  # every rank agrees
        for layer in LAYERS:
            moe = single_rank.blocks[layer].moe
            hot = scenario.hot if not scenario.rebalance else ()
            assert_single_rank_output(result[scenario.name]["outputs"][layer], moe, hot,
                                      inputs(scenario, rank, layer, cfg.hidden_size), f"rank {rank} layer {layer}")
    # every routed pair was counted once, for its logical expert and for the slot that computed it
    k = cfg.num_experts_per_token
    pairs = k * sum(tokens_of(scenario, r) for r in range(world_size))
    for layer in LAYERS:
        routed = sum(r[scenario.name]["routed"][layer] for r in results)
        slots = sum(r[scenario.name]["slots"][layer] for r in results)
        assert int(routed.sum()) == int(slots.sum()) == pairs
        per_expert = [int(sum(slots[s] for s in copies)) for copies in placement.replicas(layer)]
        assert per_expert == routed.tolist()
    if scenario.capacity is not None:
        assert all(r[scenario.name]["second_rounds"] >= 1 for r in results)


def test_copies_share_the_hot_experts_work(ranks, single_rank):
    """Every token picks the two hot experts: the contiguous placement leaves half the ranks idle
    (imbalance 2); the copies spread the work as the policy estimated."""
    world_size, results = ranks
    experts = single_rank.cfg.num_routed_experts
    placement = ExpertPlacement(experts, world_size, results[0]["redundant_hot"]["placement"])
    for layer in LAYERS:
        slots = sum(r["redundant_hot"]["slots"][layer] for r in results)
        computed = slots.view(world_size, -1).sum(dim=1).tolist()  # the pairs each rank's experts computed
        measured = max(computed) * world_size / sum(computed)
        hot = next(s for s in SCENARIOS if s.name == "redundant_hot").hot
        estimate = placement.rank_loads(layer, [1.0 if e in hot else 0.0 for e in range(experts)])
        assert measured < 2.0 and measured <= max(estimate) * world_size / sum(estimate) + 0.1, computed


def test_rebalance_moves_the_weights_of_the_new_placement(ranks, single_rank):
    world_size, results = ranks
    cfg = single_rank.cfg
    scenario = next(s for s in SCENARIOS if s.name == "rebalance")
    before = placement_of(scenario, world_size, cfg.num_layers, cfg.num_routed_experts)
    after = ExpertPlacement(cfg.num_routed_experts, world_size, results[0]["rebalance"]["placement"])
    assert all(r["rebalance"]["changed"] for r in results) and after != before
    loads = sum(r["rebalance"]["window"] for r in results).tolist()  # the warm-up's routings, all ranks
    for layer in range(cfg.num_layers):  # a layer moves only for a clear gain (MIN_GAIN)
        if after.layers[layer] != before.layers[layer]:
            old, new = max(before.rank_loads(layer, loads[layer])), max(after.rank_loads(layer, loads[layer]))
            assert layer in LAYERS and new < (1 - MIN_GAIN) * old, layer  # (the other layers routed nothing)
    for rank, result in enumerate(results):
        for layer in LAYERS:
            full = expert_tensors(single_rank.blocks[layer].moe.experts)
            held = result["rebalance"]["experts"][layer]
            for slot, expert in enumerate(after.rank_experts(layer, rank)):
                for mine, reference in zip(held, full):
                    assert torch.equal(mine[slot].view(torch.uint8), reference[expert].view(torch.uint8)), \
                        (rank, layer, slot, expert)
