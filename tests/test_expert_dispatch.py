"""The expert dispatch over real gloo processes equals one rank holding every expert, bit for bit.

``expert_dispatch_ranks.py`` runs each rank (its own process, its share of the experts of the
tiny checkpoint, a real gloo group) through every scenario on two MoE layers; this module
recomputes each rank's inputs with a single rank holding all experts and no dispatcher, and
requires identical outputs. Scenarios: the default (worst-case) capacity; a capacity lowered below
what the step needs (rows overflow into the second round, counted); every token routed to rank
0's experts, with the worst-case capacity (no overflow) and with a capacity factor of 1 (overflow);
no fixed capacity (sized per layer); one busy rank with every other rank idle (zero tokens, still
in every exchange: no deadlock); the same with the step's largest batch announced (exchanges
shrink to it). Each world size (1, 2, 4) is one group of processes running all scenarios.
"""

from __future__ import annotations

import math

import pytest
from expert_dispatch_ranks import (LAYERS, SCENARIOS, assert_single_rank_output, hot_experts, inputs, rank_main,
                                   run_rank_processes)

from model.loader import load_model
from workers.expert_capacity import ExpertCapacity, peer_share

RANKS_TIMEOUT_S = 300  # a deadlocked exchange shows as ranks still running after this


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def run_ranks(world_size: int, checkpoint: str, tmp_path) -> list[dict]:
    return run_rank_processes(rank_main, world_size, checkpoint, tmp_path, RANKS_TIMEOUT_S)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def ranks(request, tiny_checkpoint, tmp_path_factory):
    world_size = request.param
    return world_size, run_ranks(world_size, str(tiny_checkpoint), tmp_path_factory.mktemp(f"ep{world_size}"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_dispatch_equals_single_rank(ranks, single_rank, scenario):
    world_size, results = ranks
    cfg = single_rank.cfg
    for rank, result in enumerate(results):
        for layer in LAYERS:
            moe = single_rank.blocks[layer].moe
            hot = hot_experts(cfg.num_routed_experts, world_size) if scenario.hot else ()
            assert_single_rank_output(result[scenario.name]["outputs"][layer], moe, hot,
                                      inputs(scenario, rank, layer, cfg.hidden_size), f"rank {rank} layer {layer}")
    stats = [result[scenario.name]["stats"] for result in results]
    assert all(s["exchanges"] == len(LAYERS) for s in stats)
    if scenario.expect_overflow and world_size > 1:  # one rank exchanges nothing, so nothing overflows
        # every rank takes part in the second round of a layer where any rank overflowed
        assert all(s["second_rounds"] >= 1 for s in stats), stats
        assert len({s["second_rounds"] for s in stats}) == 1, stats
        assert sum(s["overflow_rows"] for s in stats) > 0, stats
    else:
        assert all(s["second_rounds"] == 0 and s["overflow_rows"] == 0 for s in stats), stats


def test_more_tokens_than_announced_is_refused(ranks):
    _, results = ranks
    for result in results:
        assert "more than the 1 announced" in result["over_announced"]


def test_capacity_plan():
    worst = ExpertCapacity.plan(64, 512, world_size=8, num_experts=384, top_k=6)
    assert worst.tokens_per_peer == worst.worst_case == 512 and not worst.can_overflow
    assert ExpertCapacity.plan(256, 128, world_size=2, num_experts=4, top_k=2).worst_case == 256
    # uniform routing: a peer receives the tokens that picked at least one of its experts
    assert peer_share(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert peer_share(384, 1, 6) == 1.0
    share = peer_share(384, 8, 6)
    assert share == pytest.approx(1 - math.comb(336, 6) / math.comb(384, 6))
    lowered = ExpertCapacity.plan(64, 512, world_size=8, num_experts=384, top_k=6, capacity_factor=1.5)
    assert lowered.tokens_per_peer == math.ceil(1.5 * share * 512) and lowered.can_overflow
    generous = ExpertCapacity.plan(64, 512, world_size=8, num_experts=384, top_k=6, capacity_factor=100)
    assert generous.tokens_per_peer == 512  # never above the worst case
    with pytest.raises(ValueError, match="factor"):
        ExpertCapacity.plan(64, 512, world_size=8, num_experts=384, top_k=6, capacity_factor=0)
    with pytest.raises(ValueError, match="tokens per peer"):
        ExpertCapacity(0, 512)
