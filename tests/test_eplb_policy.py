"""The expert load balancing policy and its pieces, without processes: the placement from loads
(workers/expert_placement.py), the weight moves a placement change needs (expert_weight_moves.py),
the slot choice and counters of an MoE layer (expert_load.py), the statistics file
(expert_load_file.py) and the engine core's imbalance gauge (engine_core/expert_load_stats.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from engine_core.expert_load_stats import ExpertLoadStats
from engine_core.protocol import ExpertLoadReport, SchedulerStats, StepResult
from workers.expert_load import LayerExpertMap
from workers.expert_load_file import (ExpertLoadCounts, ExpertLoadFileError, read_expert_load,
                                      write_expert_load)
from workers.expert_placement import (ExpertPlacement, _pack, balanced_placement, check_placement_size,
                                      replica_counts)
from workers.expert_weight_moves import apply_moves, plan_moves


def zipf_loads(seed: int, layers: int, experts: int, exponent: float = 1.2, tokens: int = 100_000) -> list[list[int]]:
    """Skewed routing counts: each layer's experts ranked at random, load ~ 1 / rank^exponent."""
    rng = random.Random(seed)
    loads = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        weights = [1.0 / (1 + order[e]) ** exponent for e in range(experts)]
        total = sum(weights)
        loads.append([int(tokens * w / total) for w in weights])
    return loads


def check_valid(placement: ExpertPlacement, experts: int, world: int, redundant: int) -> None:
    assert placement.num_slots == experts + redundant and placement.slots_per_rank * world == experts + redundant
    for layer in range(placement.num_layers):
        assert sorted(set(placement.layers[layer])) == list(range(experts))  # every expert at least once
        assert all(len(placement.rank_experts(layer, r)) == placement.slots_per_rank for r in range(world))


@pytest.mark.parametrize("experts,world,redundant", [(4, 2, 0), (4, 2, 2), (4, 4, 4), (64, 8, 0), (64, 8, 8),
                                                     (256, 16, 32), (60, 8, 4)])
def test_placement_is_valid_and_never_worse_than_contiguous(experts, world, redundant):
    for seed in range(5):
        loads = zipf_loads(seed, layers=3, experts=experts)
        placement = balanced_placement(loads, world, redundant)
        check_valid(placement, experts, world, redundant)
        if experts % world == 0:
            contiguous = ExpertPlacement.contiguous(3, experts, world)
            assert placement.imbalance(loads) <= contiguous.imbalance(loads) + 1e-12
            for layer in range(3):
                assert max(placement.rank_loads(layer, loads[layer])) <= \
                    max(contiguous.rank_loads(layer, loads[layer])) + 1e-9
        # the packing puts the copies of an expert on different ranks (the plain layout may not, when
        # its fixed slots leave no other room: it is kept only when it is estimated better anyway)
        for expert_loads in loads:
            counts = replica_counts(expert_loads, redundant, world)
            for group in _pack(expert_loads, counts, world, (experts + redundant) // world):
                assert len(group) == len(set(group))


def test_skewed_loads_are_balanced_much_better():
    loads = zipf_loads(7, layers=4, experts=256)
    contiguous = ExpertPlacement.contiguous(4, 256, 8).imbalance(loads)
    plain = balanced_placement(loads, 8, 0).imbalance(loads)
    redundant = balanced_placement(loads, 8, 16).imbalance(loads)
    assert contiguous > 1.5  # the skew is real
    assert plain < contiguous and redundant < 1.05 and redundant <= plain


def test_placement_is_deterministic_and_stable():
    loads = zipf_loads(3, layers=2, experts=32)
    first = balanced_placement(loads, 4, 4)
    assert balanced_placement([list(row) for row in loads], 4, 4) == first
    # rebalancing with the same loads moves nothing
    assert balanced_placement(loads, 4, 4, previous=first) == first
    assert all(not plan_moves(a, b, 4) for a, b in zip(first.layers, first.layers))


def test_uniform_loads_without_redundancy_keep_the_contiguous_placement():
    placement = balanced_placement([[5] * 8] * 3, 4, 0)
    assert placement == ExpertPlacement.contiguous(3, 8, 4) and placement.is_contiguous()
    with_copies = balanced_placement([[1] * 8] * 3, 4, 4)
    check_valid(with_copies, 8, 4, 4)
    assert with_copies.imbalance([[1] * 8] * 3) == 1.0  # copies of experts 0-3, packed evenly
    assert sorted(with_copies.layers[0]) == sorted(list(range(8)) + [0, 1, 2, 3])


def test_replicas_go_to_the_hottest_experts():
    assert replica_counts([10, 1, 1, 4], 2, 4) == [3, 1, 1, 1]  # 10 -> 5 -> 3.3 still above 4
    assert replica_counts([10, 1, 1, 6], 2, 4) == [2, 1, 1, 2]
    assert replica_counts([10, 1, 0, 0], 2, 2) == [2, 2, 1, 1]  # never more copies than ranks
    assert replica_counts([0, 0, 0, 0], 2, 2) == [2, 2, 1, 1]  # ties: lowest id first


def test_placement_size_checks():
    check_placement_size(4, 2, 2)
    with pytest.raises(ValueError, match="evenly"):
        check_placement_size(4, 2, 1)
    with pytest.raises(ValueError, match="one copy"):
        check_placement_size(4, 2, 6)
    with pytest.raises(ValueError, match="every expert"):
        ExpertPlacement(4, 2, ((0, 1, 2, 2),))


def test_planned_moves_turn_the_old_slots_into_the_new():
    rng = random.Random(0)
    for _ in range(30):
        world, experts, redundant = rng.choice([(2, 4, 2), (4, 8, 4), (4, 16, 0), (8, 16, 8)])
        old = balanced_placement(zipf_loads(rng.randrange(100), 1, experts), world, redundant).layers[0]
        new = balanced_placement(zipf_loads(rng.randrange(100), 1, experts), world, redundant,
                                 previous=ExpertPlacement(experts, world, (old,))).layers[0]
        moves = plan_moves(old, new, world)
        per_rank = len(old) // world
        result = list(old)
        for m in moves:  # every source is read from the old slots
            assert old[m.source_rank * per_rank + m.source_slot] == new[m.target_rank * per_rank + m.target_slot]
            result[m.target_rank * per_rank + m.target_slot] = old[m.source_rank * per_rank + m.source_slot]
        assert tuple(result) == new
        assert len({(m.target_rank, m.target_slot) for m in moves}) == len(moves)


def test_apply_moves_on_one_rank_rewrites_slots_in_place():
    from model.config import WeightFormat
    from model.kernels import ExpertWeights, QuantizedWeight

    values = torch.arange(4 * 3 * 2, dtype=torch.int8).view(4, 3, 2)  # four slots of distinct bytes
    scales = torch.arange(4 * 3, dtype=torch.uint8).view(4, 3, 1).view(torch.float8_e8m0fnu)
    plain = torch.randn(4, 2, 5).to(torch.bfloat16)
    experts = ExpertWeights(QuantizedWeight(values.clone(), scales.clone(), WeightFormat.FP4), plain.clone(),
                            plain.clone(), 0, 10.0)
    addresses = [experts.w1.values.data_ptr(), experts.w3.data_ptr()]
    old, new = (0, 1, 2, 3), (3, 0, 0, 2)  # a swap through the slots themselves, and a copy
    moves = plan_moves(old, new, 1)
    assert apply_moves(experts, moves, rank=0, world_size=1) == 4
    assert [experts.w1.values.data_ptr(), experts.w3.data_ptr()] == addresses
    for slot, expert in enumerate(new):
        assert torch.equal(experts.w1.values[slot], values[expert])
        assert torch.equal(experts.w1.scales[slot].view(torch.uint8), scales[expert].view(torch.uint8))
        assert torch.equal(experts.w3[slot], plain[expert])


def test_expert_map_spreads_tokens_over_copies_and_counts():
    placement = ExpertPlacement(4, 2, ((0, 1, 0, 2, 3, 0),))  # expert 0 in slots 0, 2 and 5
    routed, slots = torch.zeros(4, dtype=torch.long), torch.zeros(6, dtype=torch.long)
    expert_map = LayerExpertMap(placement, 0, rank=1, routed=routed, slots=slots, static=False)
    indices = torch.tensor([[0, 1]] * 6 + [[3, 2]])
    chosen = expert_map.route(indices)
    assert routed.tolist() == [6, 6, 1, 1]
    assert chosen[:6, 0].tolist() == [2, 5, 0, 2, 5, 0]  # (token + rank) mod 3 over slots [0, 2, 5]
    assert chosen[:, 1].tolist() == [1] * 6 + [3] and chosen[6, 0].item() == 4
    assert slots.tolist() == [2, 6, 2, 1, 1, 2]
    identity = LayerExpertMap(ExpertPlacement.contiguous(1, 4, 2), 0, 0, torch.zeros(4, dtype=torch.long),
                              torch.zeros(4, dtype=torch.long), static=True)
    assert identity.identity and identity.route(indices) is indices
    assert identity.slots.tolist() == identity.routed.tolist() == [6, 6, 1, 1]


def test_padding_rows_of_a_graph_batch_are_no_load():
    """A CUDA-graph batch ends in padding rows: only the first ``counted_rows`` rows count."""
    placement = ExpertPlacement(4, 2, ((0, 1, 0, 2, 3, 0),))
    routed, slots = torch.zeros(4, dtype=torch.long), torch.zeros(6, dtype=torch.long)
    counted = torch.full((), 2, dtype=torch.long)
    expert_map = LayerExpertMap(placement, 0, rank=0, routed=routed, slots=slots, static=False, counted_rows=counted)
    expert_map.route(torch.tensor([[0, 1], [2, 3], [0, 1], [0, 1]]))  # rows 2 and 3 are padding
    assert routed.tolist() == [1, 1, 1, 1] and slots.sum().item() == 4


def test_stats_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "sub" / "load.json"
    assert read_expert_load(path, 2, 3) is None
    counts = ExpertLoadCounts(((1, 2, 3), (4, 5, 6)))
    write_expert_load(path, counts)
    assert read_expert_load(path, 2, 3) == counts
    assert json.loads(path.read_text())["tokens"] == [[1, 2, 3], [4, 5, 6]]
    assert (counts + counts).total == 42
    with pytest.raises(ExpertLoadFileError, match="recorded for 2 MoE layers of 3 experts; this model has 3 of 3"):
        read_expert_load(path, 3, 3)
    bad = tmp_path / "bad.json"
    for text, message in (("{", "not a readable"), ('{"format": "x"}', "not an expert-load file"),
                          ('{"format": "mini-deepinfer-expert-load", "version": 2}', "version 2"),
                          ('{"format": "mini-deepinfer-expert-load", "version": 1, "num_layers": 1, '
                           '"num_experts": 2, "tokens": [[1, -1]]}', "counts >= 0")):
        bad.write_text(text)
        with pytest.raises(ExpertLoadFileError, match=message):
            read_expert_load(bad, 1, 2)


def _report(routed: list[list[int]], slots: list[list[int]], rebalances: int = 0) -> ExpertLoadReport:
    return ExpertLoadReport(len(routed), len(routed[0]), len(slots[0]), np.array(routed, dtype="<i8").tobytes(),
                            np.array(slots, dtype="<i8").tobytes(), rebalances)


def test_engine_side_imbalance_and_file(tmp_path):
    path = tmp_path / "load.json"
    write_expert_load(path, ExpertLoadCounts(((1, 1), (1, 1))))  # a previous run's counts
    stats = ExpertLoadStats(2, str(path))
    assert stats.fill(SchedulerStats()).expert_load_imbalance == 1.0
    # 2 experts + 2 copies: rank 0 holds slots 0-1, rank 1 slots 2-3. Window 1: layer 0 ranks
    # (30, 10), layer 1 (20, 20): imbalance (30 + 20) / (20 + 20)
    stats.add([StepResult(16, 0, [], expert_load=_report([[5, 0], [0, 5]], [[20, 5, 5, 0], [10, 0, 5, 5]])),
               StepResult(16, 1, [], expert_load=_report([[0, 3], [3, 0]], [[0, 5, 0, 5], [5, 5, 0, 10]],
                                                         rebalances=1))])
    filled = stats.fill(SchedulerStats())
    assert filled.expert_load_imbalance == pytest.approx(50 / 40)
    assert filled.rank_expert_pairs == [50, 30] and filled.expert_rebalances == 1
    # window 2 (cumulative counters): only layer 0 moves, 10 pairs on each rank
    stats.add([StepResult(32, 0, [], expert_load=_report([[6, 0], [0, 5]], [[30, 5, 5, 10], [10, 0, 5, 5]])),
               StepResult(32, 1, [], expert_load=_report([[0, 4], [3, 0]], [[0, 5, 0, 5], [5, 5, 0, 10]]))])
    assert stats.fill(SchedulerStats()).expert_load_imbalance == pytest.approx(1.0)
    assert stats.fill(SchedulerStats()).rank_expert_pairs == [60, 40]
    stats.add([StepResult(33, 0, [])])  # a step without reports changes nothing
    assert stats.fill(SchedulerStats()).expert_load_imbalance == pytest.approx(1.0)
    stats.save()
    assert read_expert_load(path, 2, 2).tokens == ((7, 5), (4, 6))  # the previous run's plus this run's
    stats.save()  # saving twice does not count this run twice
    assert read_expert_load(path, 2, 2).tokens == ((7, 5), (4, 6))


def test_policy_benchmark_runs():
    from benchmarks.eplb_policy import parse_args, run

    result = run(parse_args(["--layers", "2", "--experts", "16", "--world-sizes", "2,4",
                             "--redundant-per-rank", "0,1"]))
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        assert 1.0 <= row["balanced"] <= row["contiguous"] and row["moved_per_rank_kept"] >= 0
