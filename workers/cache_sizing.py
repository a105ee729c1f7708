"""How many KV blocks and state slots a worker allocates.

``--num-blocks`` / ``--num-state-slots`` win when given. Otherwise slots default to
``max_num_seqs`` and blocks come from a memory budget: on CUDA, the fraction
``--gpu-memory-utilization`` of the device memory minus what the weights and a profiling forward of
``max_num_batched_tokens`` tokens used at peak; on CPU, ``--cpu-kv-cache-gb``. Block count never
exceeds what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. Block and slot sizes
are those of the cache's storage formats (model/cache.py, model/cache_formats.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine_core.config import EngineConfig, EngineConfigError
from model.cache import bytes_per_block, bytes_per_slot
from model.config import V41Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheCapacity:
    num_blocks: int  # including the padding block 0
    num_slots: int
    block_size: int
    max_model_len: int

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def plan_capacity(config: EngineConfig, cfg: V41Config, free_bytes: int | None) -> CacheCapacity:
    """Decide the cache geometry. ``free_bytes``: memory left for caches (None on CPU: use the budget)."""
    if config.max_model_len is not None and config.max_model_len > cfg.max_position_embeddings:
        # the CLI refuses this before any process starts; the offline API reaches it here
        raise EngineConfigError(f"max_model_len {config.max_model_len} is above the model's limit "
                                f"(max_position_embeddings {cfg.max_position_embeddings})")
    max_len = config.max_model_len or cfg.max_position_embeddings
    slots = config.num_state_slots or config.max_num_seqs
    per_block = bytes_per_block(cfg, config.block_size)
    useful_blocks = 1 + slots * -(-max_len // config.block_size)
    if config.num_blocks is not None:
        blocks = config.num_blocks
    else:
        budget = free_bytes if free_bytes is not None else int(config.cpu_kv_cache_gb * 2**30)
        budget -= slots * bytes_per_slot(cfg)
        if budget < 2 * per_block:
            raise RuntimeError(f"no memory left for the KV cache: {budget / 2**20:.1f} MiB after the state slots; "
                               "lower --max-num-seqs or raise the memory budget")
        blocks = min(budget // per_block, useful_blocks)
    capacity = CacheCapacity(int(blocks), int(slots), config.block_size, max_len)
    log.info("cache: %d KV blocks (%d tokens at %g bytes each, %.1f MiB) and %d state slots (%.1f MiB) per rank",
             capacity.num_blocks - 1, capacity.tokens, per_block / config.block_size,
             capacity.num_blocks * per_block / 2**20, slots, slots * bytes_per_slot(cfg) / 2**20)
    return capacity


def free_cuda_bytes_after_profile(config: EngineConfig, profile) -> int:
    """Run ``profile()`` (a forward of the largest prefill) and return the memory left for caches."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profile()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    free = int(total * config.gpu_memory_utilization) - peak
    log.info("profiling forward: peak %.2f GiB of %.2f GiB; %.2f GiB left for caches at utilization %.2f",
             peak / 2**30, total / 2**30, free / 2**30, config.gpu_memory_utilization)
    return free
