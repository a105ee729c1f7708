"""Every rank of a multi-node deployment must run with the same engine settings.

Each node resolves its own command line, so nothing but this check stops node 1 from running with,
say, another ``--max-num-batched-tokens`` than node 0: its MoE exchanges would then have other
shapes, and the first collective would hang or fail far from the cause. Right after joining
torch.distributed, every worker sends its settings (JSON, as bytes in a tensor: nothing pickled) to
all ranks and refuses to start if any differs from rank 0's, naming the rank, its node and the
fields; the engine core reports that as the reason the server cannot start.

Settings that may differ per node are left out: where the checkpoint lies (its config.json is
compared instead), how much memory a node gives the caches (the engine core uses the smallest
cache of any rank), its CPU threads, and what only the engine core on node 0 reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import msgspec

from engine_core.cluster import NodeLayout
from engine_core.config import EngineConfig

PER_NODE_FIELDS = frozenset({
    "model", "node_rank", "headless", "cluster_key_file", "num_blocks", "num_state_slots",
    "gpu_memory_utilization", "cpu_kv_cache_gb", "cpu_threads", "engram_storage",
    # read by the engine core alone
    "max_queued_requests", "max_seqs_per_request", "step_timeout", "seed", "generation_config", "join_timeout",
})
MODEL_CONFIG_KEY = "config.json (sha256)"


def shared_settings(config: EngineConfig) -> dict[str, object]:
    """The settings every rank must agree on, with the digest of the model's config.json."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in PER_NODE_FIELDS}
    # as resolved: a default and the value it resolves to are the same setting
    values["kernels"] = config.resolved_kernels
    values["batch_invariant"] = config.resolved_batch_invariant
    values["hf_overrides"] = config.model_overrides  # the values, not how the JSON was written
    if "eplb_stats_file" in values:  # rank 0 reads it for all (workers/expert_balancer.py): only whether it is given
        values["eplb_stats_file"] = values["eplb_stats_file"] is not None
    values[MODEL_CONFIG_KEY] = hashlib.sha256((Path(config.model) / "config.json").read_bytes()).hexdigest()[:16]
    return values


def differing_settings(reference: dict[str, object], other: dict[str, object]) -> list[str]:
    """``"name: other (rank 0: reference)"`` for every setting that differs, in name order."""
    names = sorted(set(reference) | set(other))
    return [f"{name}: {other.get(name)!r} (rank 0: {reference.get(name)!r})"
            for name in names if reference.get(name) != other.get(name)]


def check_ranks_agree(config: EngineConfig, rank: int) -> None:
    """Collective (every rank calls it once, after joining the process group): ValueError naming the
    ranks whose settings differ from rank 0's."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    mine = msgspec.json.encode(shared_settings(config))
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64, device=device))
    longest = int(max(length.item() for length in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    settings = [msgspec.json.decode(bytes(g[:int(n.item())].cpu().tolist())) for g, n in zip(gathered, lengths)]
    layout = NodeLayout.of(config)
    problems = [f"rank {r} (node {layout.node_of(r)}) has {'; '.join(diff)}"
                for r in range(1, world) if (diff := differing_settings(settings[0], settings[r]))]
    if problems:
        raise ValueError(f"the nodes run with different engine settings: {' / '.join(problems)}; give every node "
                         "the same model and engine flags")
