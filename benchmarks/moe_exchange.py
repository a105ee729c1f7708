"""Expert parallelism over several GPUs: one MoE layer's dispatch and combine across ranks.

    python benchmarks/moe_exchange.py --world-size 2 --preset v41-flash-L8 --tokens 1,64,256,1024

One process per GPU, an NCCL group of ``--world-size`` ranks (as ``serve --dp N`` runs them). Every
rank builds layer ``--layer``'s MoE of the preset with dummy weights (``benchmarks/moe_dispatch.py``'s
``build_moe``; the routed experts it does not own are simply never called) and, for each token count
n per rank, on random bf16 inputs (roughly uniform routing), times

* ``local``: the layer on the rank's own tokens with every expert on the rank (what ``--dp 1`` does
  per GPU, and the upper bound of what sharding can save);
* ``expert parallel``: the layer with the experts sharded over the ranks: one dispatch, the rank's
  experts on what it received, one combine (``workers/expert_parallel.py``), with the step's tokens
  announced as a worker does;
* ``exchange only``: dispatch and combine around experts that return zeros: the communication and
  packing cost of one MoE layer by itself.

Timing: after warm-up and a barrier, each rank queues ``--reps`` calls back to back between two CUDA
events; the time per call is the slowest rank's average (a collective finishes with its last rank).
Host launch time is included where the device outruns the host (eager PyTorch, as the engine runs
an MoE layer under expert parallelism today). The outputs of ``expert parallel`` must equal
``local`` bit for bit on every rank (exit status 1 otherwise): the Triton expert kernels are
row-independent and the combine sums in the reference's order.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.moe_dispatch import build_moe, preset_config, zero_experts  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: gloo ranks, the tiny preset and the reference kernels (checks the script)")
    parser.add_argument("--preset", default=None, help="default: v41-flash-L8 on cuda, tiny on cpu")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--tokens", default="1,64,256,1024", help="token counts per rank, comma-separated")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="step limit of the worst-case capacity")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.preset = args.preset or ("v41-flash-L8" if args.device == "cuda" else "tiny")
    return args


def _time_per_call(call, reps: int, device: torch.device) -> float:
    """Seconds per call, the slowest rank's average over ``reps`` back-to-back calls."""
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize()
        per_call = start.elapsed_time(end) / 1e3 / reps
    else:
        started = time.perf_counter()
        for _ in range(reps):
            call()
        per_call = (time.perf_counter() - started) / reps
    seconds = torch.tensor([per_call], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    from workers.expert_capacity import ExpertCapacity
    from workers.expert_parallel import ExpertParallelDispatcher

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.world_size)
    cfg = preset_config(args.preset)
    # row-independent expert kernels, so that sharding the experts changes no bit
    kernels, batch_invariant = ("triton", False) if device.type == "cuda" else ("reference", True)
    moe = build_moe(cfg, args.layer, kernels, batch_invariant, device)
    capacity = ExpertCapacity.plan(args.max_num_seqs, args.max_num_batched_tokens, world_size=args.world_size,
                                   num_experts=cfg.num_routed_experts, top_k=cfg.num_experts_per_token)
    dispatcher = ExpertParallelDispatcher(rank, args.world_size, cfg.num_routed_experts, capacity=capacity)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    rows, exact = [], True
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
        dispatcher.set_step_tokens(n)

        def local():
            moe.dispatcher = None
            return moe(x)

        def expert_parallel():
            moe.dispatcher = dispatcher
            return moe(x)

        def exchange_only():
            weights, indices = moe.router(x)
            return dispatcher.combine(dispatcher.dispatch(x, weights, indices), zero_experts)

        same = torch.equal(local(), expert_parallel())
        flags = torch.tensor([int(same)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        exact = exact and bool(flags.item())
        row = dict(tokens_per_rank=n, bit_exact=bool(flags.item()))
        for key, call in (("local_ms", local), ("expert_parallel_ms", expert_parallel),
                          ("exchange_only_ms", exchange_only)):
            row[key] = _time_per_call(call, args.reps, device) * 1e3
        rows.append(row)
    if rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (gloo, 1 thread per rank)"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
        results.put(dict(conditions=dict(device=name, world_size=args.world_size,
                                         torch=torch.__version__, preset=args.preset, layer=args.layer,
                                         hidden=cfg.hidden_size, routed_experts=cfg.num_routed_experts,
                                         top_k=cfg.num_experts_per_token, nccl=nccl,
                                         tokens_per_peer=capacity.tokens_per_peer, reps=args.reps),
                         rows=rows, bit_exact=exact))
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(args, port, results), nprocs=args.world_size, start_method="spawn")
    result = results.get(timeout=10)
    c = result["conditions"]
    print(f"MoE layer {c['layer']} of {c['preset']} (D {c['hidden']}, {c['routed_experts']} experts top-{c['top_k']}) "
          f"on {c['world_size']} x {c['device']}, NCCL {c['nccl']}, torch {c['torch']}; capacity "
          f"{c['tokens_per_peer']} tokens per peer; {c['reps']} calls back to back, slowest rank\n")
    print("| tokens per rank | local, all experts (ms) | expert parallel (ms) | exchange only (ms) | bit-exact |")
    print("|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['tokens_per_rank']} | {r['local_ms']:.3f} | {r['expert_parallel_ms']:.3f} | "
              f"{r['exchange_only_ms']:.3f} | {'yes' if r['bit_exact'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
