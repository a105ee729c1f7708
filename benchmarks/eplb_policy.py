"""The expert placement policy on synthetic skewed loads: the imbalance it reaches, its time, and
how many experts a rebalance moves.

Run (from the repository root)::

    .venv/bin/python benchmarks/eplb_policy.py                      # V4.1-Flash sizes: 40 layers x 384 experts
    .venv/bin/python benchmarks/eplb_policy.py --world-sizes 8,64 --redundant-per-rank 0,1,4 --json

Loads: per layer, the experts in a random order with routed tokens ~ 1 / rank^skew (Zipf; real
routing logs of DeepSeek models are skewed but less than ``--skew 1``; see
docs/expert-load-balance.md). For each world size W and redundant experts R (a multiple of W), the
script reports the estimated imbalance (sum over layers of the busiest rank's load over the mean's,
``ExpertPlacement.imbalance``) of the contiguous placement and of ``balanced_placement``, the
policy's time (host, one call for all layers), and, when the loads drift (a second draw mixed with
the first, ``--drift``), the rebalanced placement's imbalance and time and the slots the rebalance
moves to another rank, per rank, with ``previous`` given (experts kept where they are) and without
it (a fresh packing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.expert_placement import ExpertPlacement, balanced_placement  # noqa: E402
from workers.expert_weight_moves import plan_moves  # noqa: E402


def zipf_loads(rng: random.Random, layers: int, experts: int, skew: float) -> list[list[float]]:
    loads = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        loads.append([1e6 / (1 + order[e]) ** skew for e in range(experts)])
    return loads


def moved_per_rank(old: ExpertPlacement, new: ExpertPlacement) -> float:
    crossing = sum(m.crosses_ranks for a, b in zip(old.layers, new.layers) for m in plan_moves(a, b, old.world_size))
    return crossing / old.world_size


def run(args) -> dict:
    rng = random.Random(args.seed)
    loads = zipf_loads(rng, args.layers, args.experts, args.skew)
    other = zipf_loads(rng, args.layers, args.experts, args.skew)
    drifted = [[(1 - args.drift) * a + args.drift * b for a, b in zip(x, y)] for x, y in zip(loads, other)]
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        contiguous = ExpertPlacement.contiguous(args.layers, args.experts, world)
        for per_rank in (int(r) for r in args.redundant_per_rank.split(",")):
            redundant = per_rank * world
            start = time.perf_counter()
            placement = balanced_placement(loads, world, redundant)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            following = balanced_placement(drifted, world, redundant, previous=placement)
            rebalance_seconds = time.perf_counter() - start
            fresh = balanced_placement(drifted, world, redundant)
            rows.append(dict(world_size=world, redundant=redundant, contiguous=contiguous.imbalance(loads),
                             balanced=placement.imbalance(loads), policy_ms=seconds * 1e3,
                             rebalance_ms=rebalance_seconds * 1e3,
                             after_drift=following.imbalance(drifted),
                             moved_per_rank_kept=moved_per_rank(placement, following),
                             moved_per_rank_fresh=moved_per_rank(placement, fresh)))
    return dict(conditions=dict(layers=args.layers, experts=args.experts, skew=args.skew, drift=args.drift,
                                seed=args.seed), rows=rows)


def markdown(result: dict) -> str:
    c = result["conditions"]
    lines = [f"{c['layers']} layers x {c['experts']} experts, Zipf loads (skew {c['skew']}), seed {c['seed']}; "
             f"drift {c['drift']}.", "",
             "| W | redundant | contiguous | balanced | policy (ms) | after drift | rebalance (ms) | "
             "moved/rank (kept) | moved/rank (fresh) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['world_size']} | {r['redundant']} | {r['contiguous']:.3f} | {r['balanced']:.3f} | "
                     f"{r['policy_ms']:.1f} | {r['after_drift']:.3f} | {r['rebalance_ms']:.1f} | "
                     f"{r['moved_per_rank_kept']:.1f} | "
                     f"{r['moved_per_rank_fresh']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--world-sizes", default="8,16,32,64")
    parser.add_argument("--redundant-per-rank", default="0,1,2")
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--drift", type=float, default=0.3, help="share of a second random draw in the new loads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table on stderr)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(markdown(result), file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
