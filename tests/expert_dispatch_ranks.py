"""One rank of the expert-dispatch tests (``test_expert_dispatch.py``), run in its own process.

Each rank joins a gloo group, loads the tiny checkpoint holding only its share of the routed
experts, and runs every scenario's inputs through two MoE layers with an
``ExpertParallelDispatcher``; it saves inputs, outputs and the dispatcher's counters for the test
process to compare with a single rank holding every expert. Scenarios are plain data, so the test
process rebuilds the same inputs and router biases.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

LAYERS = (0, 3)  # two MoE layers: consecutive exchanges on the same group
HOT_BIAS = 1000.0  # added to the router bias of rank 0's experts: every token picks them first
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 8, 32  # the step limits the fixed capacities come from


@dataclass(frozen=True)
class Scenario:
    name: str
    tokens: tuple[int, ...]  # tokens per rank (cycled over the ranks)
    capacity: str  # "worst" (the default plan), "factor:<f>", "tokens:<n>" or "unsized" (no fixed capacity)
    hot: bool = False  # route every token to rank 0's experts (the most skewed step)
    announce: bool = False  # announce the step's largest batch over the ranks (set_step_tokens)
    expect_overflow: bool = False


SCENARIOS = (
    Scenario("worst_case", (13, 29, 0, 5), "worst"),
    Scenario("lowered", (13, 29, 0, 5), "tokens:3", expect_overflow=True),
    Scenario("hot_worst_case", (32, 17, 1, 0), "worst", hot=True),
    Scenario("hot_factor", (32, 17, 1, 0), "factor:0.5", hot=True, expect_overflow=True),
    Scenario("unsized", (13, 29, 0, 5), "unsized"),
    Scenario("one_busy_rank", (32, 0, 0, 0), "worst"),
    Scenario("announced", (13, 29, 0, 5), "worst", announce=True),
    Scenario("announced_unsized", (13, 29, 0, 5), "unsized", announce=True),
    Scenario("announced_fits_lowered", (13, 29, 0, 5), "tokens:30", announce=True),
    Scenario("announced_lowered", (13, 29, 0, 5), "tokens:3", announce=True, expect_overflow=True),
    Scenario("announced_one_busy_rank", (1, 0, 0, 0), "worst", announce=True),
)


def tokens_of(scenario: Scenario, rank: int) -> int:
    return scenario.tokens[rank % len(scenario.tokens)]


def inputs(scenario: Scenario, rank: int, layer: int, dim: int) -> torch.Tensor:
    """The MoE input of one rank and layer: normal bf16 rows (the scale of a normed hidden state)."""
    seed = 1000 * SCENARIOS.index(scenario) + 10 * rank + layer
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens_of(scenario, rank), dim, generator=gen).to(torch.bfloat16)


def hot_experts(num_experts: int, world_size: int) -> range:
    return range(num_experts // world_size)


def with_hot_bias(moe, hot) -> torch.Tensor:
    """The router bias to restore; the layer's bias now sends every token to the ``hot`` experts first."""
    bias = moe.router.bias.clone()
    if hot:
        moe.router.bias[list(hot)] += HOT_BIAS
    return bias


def assert_single_rank_output(got: torch.Tensor, moe, hot, x: torch.Tensor, where: str) -> None:
    """``got`` (a rank's output) is bit for bit the output of ``moe`` (holding every expert) on ``x``
    with every token sent to the ``hot`` experts first."""
    bias = with_hot_bias(moe, hot)
    try:
        expected = moe(x)
    finally:
        moe.router.bias = bias
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected), f"{where}: max diff {(got - expected).abs().max()}"


def capacity_of(scenario: Scenario, world_size: int, num_experts: int, top_k: int):
    from workers.expert_capacity import ExpertCapacity

    if scenario.capacity == "unsized":
        return None
    if scenario.capacity.startswith("tokens:"):
        worst = max(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
        return ExpertCapacity(int(scenario.capacity.removeprefix("tokens:")), worst)
    factor = float(scenario.capacity.removeprefix("factor:")) if scenario.capacity.startswith("factor:") else None
    return ExpertCapacity.plan(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, world_size=world_size, num_experts=num_experts,
                               top_k=top_k, capacity_factor=factor)


def run_rank_processes(target, world_size: int, checkpoint: str, out_dir: Path, timeout_s: float = 300) -> list[dict]:
    """Run ``target(rank, world_size, checkpoint, store_path, out_dir)`` in one spawned process per
    rank and return what each saved (``rank{r}.pt``); a rank still running after ``timeout_s`` is a
    deadlocked collective."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    store = Path(out_dir) / "store"
    procs = [context.Process(target=target, args=(rank, world_size, checkpoint, str(store), str(out_dir)))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout_s)
    stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not stuck, f"ranks {stuck} did not finish within {timeout_s} s (a deadlocked exchange)"
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]


def join_gloo_group(rank: int, world_size: int, store_path: str) -> None:
    """One CPU rank of the test's gloo group (one thread: the ranks share the machine's cores)."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))


def rank_main(rank: int, world_size: int, checkpoint: str, store_path: str, out_dir: str) -> None:
    from model.loader import load_model
    from workers.expert_parallel import ExpertParallelDispatcher

    join_gloo_group(rank, world_size, store_path)
    try:
        probe = ExpertParallelDispatcher(rank, world_size, num_experts=_num_experts(checkpoint))
        model = load_model(checkpoint, expert_range=probe.expert_range())
        cfg = model.cfg
        results = {}
        for scenario in SCENARIOS:
            capacity = capacity_of(scenario, world_size, cfg.num_routed_experts, cfg.num_experts_per_token)
            dispatcher = ExpertParallelDispatcher(rank, world_size, cfg.num_routed_experts, capacity=capacity)
            if scenario.announce:  # what every rank reads from the step plan
                dispatcher.set_step_tokens(max(tokens_of(scenario, r) for r in range(world_size)))
            outputs = {}
            for layer in LAYERS:
                moe = model.blocks[layer].moe
                bias = with_hot_bias(moe, hot_experts(cfg.num_routed_experts, world_size) if scenario.hot else ())
                moe.dispatcher = dispatcher
                x = inputs(scenario, rank, layer, cfg.hidden_size)
                outputs[layer] = moe(x)
                moe.dispatcher, moe.router.bias = None, bias
            results[scenario.name] = dict(outputs=outputs, stats=vars(dispatcher.stats).copy(),
                                          capacity=None if capacity is None else capacity.tokens_per_peer)
        results["over_announced"] = _over_announced_refused(model.blocks[LAYERS[0]].moe, dispatcher)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _num_experts(checkpoint: str) -> int:
    from model.config import V41Config

    return V41Config.from_pretrained(checkpoint).num_routed_experts


def _over_announced_refused(moe, dispatcher) -> str:
    """Every rank gets more tokens than announced: each refuses before any exchange (none waits)."""
    dispatcher.set_step_tokens(1)
    moe.dispatcher = dispatcher
    try:
        moe(torch.zeros(2, moe.router.weight.shape[1], dtype=torch.bfloat16))
    except RuntimeError as exc:
        return str(exc)
    finally:
        moe.dispatcher = None
    return ""
