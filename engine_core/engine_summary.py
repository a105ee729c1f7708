"""The engine's part of the startup summary: what it runs on, in which formats, with how much cache.

Built once in the engine-core process when the workers are ready (from the configuration, the
workers' handshake and the model's config.json) and sent to the frontend with ``ready``; the
frontend adds the version, the served names and the URL (frontend/startup_summary.py).
"""

from __future__ import annotations

from .config import EngineConfig
from .executor import WorkerInfo
from .protocol import EngineSummary

_FORMAT_NAMES = {"bf16": "bf16", "fp8": "fp8 e4m3", "fp4": "fp4 e2m1"}


def weight_formats(dense: str, experts: str) -> str:
    """How the checkpoint stores its weights, e.g. "fp8 e4m3 dense + fp4 e2m1 experts (UE8M0 block scales)"."""
    text = f"{_FORMAT_NAMES[dense]} dense + {_FORMAT_NAMES[experts]} experts"
    return text + (" (UE8M0 block scales)" if "bf16" not in (dense, experts) else "")


def cuda_graphs(config: EngineConfig, cfg, max_model_len: int) -> str:
    """What the decode steps replay, e.g. "decode, 44 graphs: 11 batch sizes 1..64 x 4 contexts up to 8192 tokens"."""
    reason = config.cuda_graphs_off_reason
    if reason is not None:
        return f"none (eager: {reason})"
    from workers.cuda_graphs import FULL_BATCH_CONTEXT, GraphPlan

    plan = GraphPlan.for_engine(config, cfg, max_model_len)
    sizes, contexts = plan.batch_sizes, plan.context_sizes
    fewer = f", fewer batch sizes beyond {FULL_BATCH_CONTEXT}" if contexts[-1] > FULL_BATCH_CONTEXT else ""
    return (f"decode, {len(plan.buckets)} graphs: {len(sizes)} batch sizes {sizes[0]}..{sizes[-1]} x "
            f"{len(contexts)} contexts up to {contexts[-1]} tokens{fewer}")


def build_summary(config: EngineConfig, info: WorkerInfo, max_model_len: int, devices: list[str],
                  kv_cache_dtype: str) -> EngineSummary:
    """``max_model_len``: the engine's effective limit (the scheduler's); ``devices`` and
    ``kv_cache_dtype`` as the workers reported them."""
    from model.cache import bytes_per_block, bytes_per_slot

    cfg = config.model_config()
    blocks = info.num_blocks - 1  # block 0 is padding
    return EngineSummary(
        devices=devices, weight_formats=weight_formats(cfg.dense_format.value, cfg.expert_format.value),
        kv_cache_dtype=kv_cache_dtype,
        kernels=config.resolved_kernels + (" with programmatic dependent launch" if config.enable_pdl else ""),
        batch_invariant=config.resolved_batch_invariant,
        zos=config.zos, cuda_graphs=cuda_graphs(config, cfg, max_model_len), dp_size=config.dp_size,
        num_routed_experts=cfg.num_routed_experts, block_size=config.block_size, kv_blocks_per_rank=blocks,
        state_slots_per_rank=info.num_slots, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
        model_max_len=cfg.max_position_embeddings,
        kv_cache_bytes_per_rank=info.num_blocks * bytes_per_block(cfg, config.block_size),
        state_bytes_per_rank=info.num_slots * bytes_per_slot(cfg))
