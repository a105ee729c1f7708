"""One MoE layer with the expert dispatch at world size 1, against the same layer without it.

Run (from the repository root)::

    .venv/bin/python benchmarks/moe_dispatch.py --device cuda --preset v41-flash-L8 --tokens 1,64,256 --json
    .venv/bin/python benchmarks/moe_dispatch.py --device cpu --preset tiny --tokens 1,16,64

One MoE layer of the preset (router, routed experts, shared expert; layer ``--layer``) is made
with dummy weights in their storage formats on the device (``model/dummy_weights.py``: no
checkpoint needed), and a torch.distributed group of one rank (NCCL on CUDA, gloo on CPU) carries
the exchanges. For every token count n, on random bf16 inputs (random hidden states: roughly
uniform routing), the script times

* ``local``: the layer without a dispatcher, what a single rank serves with (``--dp 1``);
* ``dispatch``: the layer with ``ExpertParallelDispatcher`` at world size 1, the step's tokens
  announced (``set_step_tokens(n)``, what a worker does from the step plan): exchanges of n
  records, i.e. what the dispatch path itself costs;
* ``dispatch + expert map``: the same with the expert load balancer's map installed
  (``workers/expert_load.LayerExpertMap``, not the static identity shortcut): each (token, expert)
  pair is mapped to a slot through the replica table and counted on the device, as with
  ``--num-redundant-experts`` or ``--eplb-step-interval``: what the load accounting costs per layer;
* ``dispatch, worst case``: the same without the announcement: exchanges sized for the worst case
  of ``--max-num-seqs`` / ``--max-num-batched-tokens`` (the static size a CUDA graph would hold if
  it were captured once for every batch);
* ``exchange only``: dispatch and combine around an expert function that returns zeros, at the
  announced size: the dispatch/combine time per MoE layer by itself (packing, the two
  all-to-alls, unpacking, placing the returned rows).

The outputs of ``dispatch`` must equal ``local`` bit for bit (exit status 1 otherwise) when the
expert kernels are row-independent (``triton``, or ``reference`` with ``--batch-invariant``).

Timing: ``benchmarks/device_limits.Timer``: the median of per-call CUDA-event times after
warm-up, with the host queueing ahead (the dispatch path reads nothing back to the host), or host
times on CPU; each call rotates over ``--input-sets`` inputs. At world size 1 the all-to-alls are
copies within one device: this measures the dispatch's own cost, not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.device_limits import Timer, log  # noqa: E402


def build_moe(cfg, layer: int, kernels_name: str, batch_invariant: bool, device: torch.device):
    """Layer ``layer``'s MoE of ``cfg`` with dummy weights on ``device`` (every routed expert)."""
    from model.config import WeightFormat
    from model.dummy_weights import DummyCheckpointReader
    from model.kernels import ExpertWeights, QuantizedWeight, make_backend, stack_quantized
    from model.layers import Linear
    from model.moe import MoE, Router, SharedExpert

    reader = DummyCheckpointReader(cfg, device)
    kernels = make_backend(kernels_name, batch_invariant)
    formats = {torch.float8_e4m3fn: WeightFormat.FP8, torch.int8: WeightFormat.FP4}

    def weight(name: str):
        values = reader.get(f"{name}.weight")
        if values.dtype in formats:
            return QuantizedWeight(values, reader.get(f"{name}.scale"), formats[values.dtype])
        return values

    f = f"layers.{layer}.ffn."
    stacks = []
    for proj in ("w1", "w3", "w2"):
        parts = [weight(f"{f}experts.{e}.{proj}") for e in range(cfg.num_routed_experts)]
        stacks.append(stack_quantized(parts) if isinstance(parts[0], QuantizedWeight) else torch.stack(parts))
        del parts
    experts = ExpertWeights(*stacks, first_expert=0, swiglu_limit=cfg.swiglu_limit)
    shared = SharedExpert(*(Linear(weight(f"{f}shared_experts.{p}"), kernels, batch_invariant)
                            for p in ("w1", "w2", "w3")), swiglu_limit=cfg.swiglu_limit)
    router = Router(reader.get(f + "gate.weight"), reader.get(f + "gate.bias").float(),
                    cfg.num_experts_per_token, cfg.scoring_func, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                    cfg.gate_temperature, kernels)
    return MoE(router, experts, shared, cfg.num_routed_experts, kernels).to(device)


def preset_config(preset: str):
    from model.checkpoint_maker import make_checkpoint
    from model.config import V41Config
    from model.presets import shrink_engram_config

    directory = make_checkpoint(Path(tempfile.mkdtemp()) / preset, preset=preset, config_only=True)
    return shrink_engram_config(V41Config.from_pretrained(directory))  # the tables are not used here


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, help="default: v41-flash-L8 on cuda, tiny on cpu")
    parser.add_argument("--layer", type=int, default=0, help="which layer's MoE weights (all have the same shapes)")
    parser.add_argument("--tokens", default="1,64,256", help="token counts n, comma-separated")
    parser.add_argument("--kernels", choices=["reference", "triton"], default=None,
                        help="default: triton on cuda, reference on cpu (as the engine)")
    bi = parser.add_mutually_exclusive_group()
    bi.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None)
    bi.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="step limit of the worst-case capacity")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="step limit of the worst-case capacity")
    parser.add_argument("--input-sets", type=int, default=4, help="inputs rotated over per token count")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per (variant, n)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write every number as JSON to PATH; without PATH, JSON on stdout (table on stderr)")
    args = parser.parse_args(argv)
    args.preset = args.preset or ("v41-flash-L8" if args.device == "cuda" else "tiny")
    args.kernels = args.kernels or ("triton" if args.device == "cuda" else "reference")
    if args.batch_invariant is None:
        args.batch_invariant = args.device == "cpu"
    return args


def init_single_rank_group(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def zero_experts(rows: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    return rows.new_zeros(ids.shape[0], ids.shape[1], rows.shape[1])


def run(args) -> dict:
    from workers.expert_capacity import ExpertCapacity
    from workers.expert_load import LayerExpertMap
    from workers.expert_parallel import ExpertParallelDispatcher
    from workers.expert_placement import ExpertPlacement

    device = torch.device(args.device)
    if device.type == "cpu" and args.kernels == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_single_rank_group(device)
    cfg = preset_config(args.preset)
    log(f"building layer {args.layer}'s MoE of {args.preset} on {device} ({args.kernels} kernels)")
    moe = build_moe(cfg, args.layer, args.kernels, args.batch_invariant, device)
    capacity = ExpertCapacity.plan(args.max_num_seqs, args.max_num_batched_tokens, world_size=1,
                                   num_experts=cfg.num_routed_experts, top_k=cfg.num_experts_per_token)
    dispatcher = ExpertParallelDispatcher(0, 1, cfg.num_routed_experts, capacity=capacity)
    expert_map = LayerExpertMap(ExpertPlacement.contiguous(1, cfg.num_routed_experts, 1), 0, 0,
                                torch.zeros(cfg.num_routed_experts, dtype=torch.long, device=device),
                                torch.zeros(cfg.num_routed_experts, dtype=torch.long, device=device), static=False)
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, exact = [], True
    for n in (int(t) for t in args.tokens.split(",")):
        xs = [torch.randn(n, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
              for _ in range(args.input_sets)]

        def layer(announce: int | None, with_dispatcher: bool = True, with_map: bool = False):
            def call(i: int):
                dispatcher.set_step_tokens(announce)
                moe.dispatcher = dispatcher if with_dispatcher else None
                moe.expert_map = expert_map if with_map else None
                return moe(xs[i % len(xs)])
            return call

        def exchange_only(i: int):
            x = xs[i % len(xs)]
            weights, indices = moe.router(x)
            dispatcher.set_step_tokens(n)
            return dispatcher.combine(dispatcher.dispatch(x, weights, indices), zero_experts)

        local = layer(None, with_dispatcher=False)(0)
        dispatched = layer(n)(0)
        same = torch.equal(local, dispatched) and torch.equal(local, layer(n, with_map=True)(0))
        must_match = args.kernels == "triton" or args.batch_invariant
        exact = exact and (same or not must_match)
        row = dict(tokens=n, bit_exact=same)
        variants = [("local_ms", layer(None, with_dispatcher=False)), ("dispatch_ms", layer(n)),
                    ("dispatch_expert_map_ms", layer(n, with_map=True)), ("exchange_only_ms", exchange_only)]
        if n <= capacity.worst_case:
            variants.insert(2, ("dispatch_worst_case_ms", layer(None)))
        for key, call in variants:
            timing = timer.measure(call, args.budget, min_reps=5, max_reps=2000)
            row[key] = timing.median_s * 1e3
            log(f"n={n:5d} {key:24s} {timing.median_s * 1e3:9.3f} ms ({timing.reps} reps)")
        moe.dispatcher = moe.expert_map = None
        row["dispatch_overhead_pct"] = 100.0 * (row["dispatch_ms"] / row["local_ms"] - 1.0)
        rows.append(row)
    dist.destroy_process_group()
    conditions = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__, preset=args.preset, layer=args.layer, hidden=cfg.hidden_size,
        routed_experts=cfg.num_routed_experts, top_k=cfg.num_experts_per_token,
        moe_intermediate=cfg.moe_intermediate_size, kernels=args.kernels, batch_invariant=args.batch_invariant,
        world_size=1, backend="nccl" if device.type == "cuda" else "gloo",
        worst_case_tokens_per_peer=capacity.tokens_per_peer, cpu_threads=torch.get_num_threads(),
        timing="CUDA events, median, host queued ahead" if device.type == "cuda" else "host clock, median")
    return dict(conditions=conditions, rows=rows, bit_exact=exact)


def markdown(result: dict) -> str:
    c = result["conditions"]
    lines = [f"MoE layer of {c['preset']} (D {c['hidden']}, {c['routed_experts']} experts top-{c['top_k']}, "
             f"inter {c['moe_intermediate']}) on {c['device']}, {c['kernels']} kernels, batch invariant "
             f"{c['batch_invariant']}, world size 1 ({c['backend']}), torch {c['torch']}; worst-case capacity "
             f"{c['worst_case_tokens_per_peer']} tokens; {c['timing']}.", "",
             "| tokens | local (ms) | dispatch (ms) | overhead | + expert map (ms) | dispatch, worst case (ms) | "
             "exchange only (ms) | bit-exact |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        worst = f"{r['dispatch_worst_case_ms']:.3f}" if "dispatch_worst_case_ms" in r else "-"
        lines.append(f"| {r['tokens']} | {r['local_ms']:.3f} | {r['dispatch_ms']:.3f} | "
                     f"{r['dispatch_overhead_pct']:+.1f}% | {r['dispatch_expert_map_ms']:.3f} | {worst} | "
                     f"{r['exchange_only_ms']:.3f} | "
                     f"{'yes' if r['bit_exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    table = markdown(result)
    if args.json == "-":
        print(table, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    if not result["bit_exact"]:
        log("the dispatch path's outputs differ from the local layer's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
