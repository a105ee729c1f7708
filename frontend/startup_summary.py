"""The lines ``serve`` logs once it listens: what runs where, in which formats, with how much cache.

    mini-deepinfer 0.1.0: DeepSeek-V4.1 from /models/V4.1-Flash, served as 'V4.1-Flash'
    devices: cuda:0 NVIDIA H200 (139.8 GiB), cuda:1 NVIDIA H200 (139.8 GiB)
    parallel layout: data parallel 2 (one worker per rank), 384 routed experts sharded 192 per rank
    dtypes: weights fp8 e4m3 dense + fp4 e2m1 experts (UE8M0 block scales); KV cache window fp8 e4m3
        (UE8M0 scale per 32), compressed KV fp4 e2m1 (E4M3 scale per 16), index keys fp4 e2m1 (UE8M0 scale per 32)
    kernels: triton; batch invariance off; zero-overhead scheduling on; CUDA graphs none (eager)
    KV cache: 1,048,576 tokens per rank (8192 blocks of 128, 0.87 GiB) + 64 state slots (166.5 MiB); ...
    max_model_len 65536 (model limit 1048576): max concurrency 32.00 sequences at 65536 tokens ...
    listening on http://0.0.0.0:8000 (OpenAI API under /v1, Prometheus metrics at /metrics)

The engine's part comes from its ``ready`` message (engine_core/engine_summary.py).
"""

from __future__ import annotations

import json

from engine_core.protocol import EngineSummary

PACKAGE = "mini-deepinfer"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "unknown (not installed)"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def max_concurrency(s: EngineSummary) -> tuple[float, float]:
    """(sequences of max_model_len tokens that fit at once per rank, how many the KV cache alone holds)."""
    kv = s.kv_blocks_per_rank / -(-s.max_model_len // s.block_size)  # each needs whole blocks
    return min(kv, s.state_slots_per_rank, s.max_num_seqs), kv


def summary_lines(model_dir: str, served_names: tuple[str, ...], summary: EngineSummary | None,
                  url: str, overrides: dict | None = None) -> list[str]:
    """``overrides``: ``--hf-overrides``, named after the model directory when given."""
    names = ", ".join(repr(n) for n in served_names)
    source = f"{model_dir} (config.json with {json.dumps(overrides)})" if overrides else model_dir
    lines = [f"{PACKAGE} {package_version()}: DeepSeek-V4.1 from {source}, served as {names}"]
    if summary is not None:
        s = summary
        per_rank = s.num_routed_experts // s.dp_size
        layout = (f"data parallel {s.dp_size} (one worker per rank), {s.num_routed_experts} routed experts "
                  f"sharded {per_rank} per rank" if s.dp_size > 1 else
                  f"one rank (one worker) holding all {s.num_routed_experts} routed experts")
        tokens = s.kv_blocks_per_rank * s.block_size
        per_rank_conc, kv_conc = max_concurrency(s)
        lines += [
            f"devices: {', '.join(s.devices) or 'unknown'}",
            f"parallel layout: {layout}",
            f"dtypes: weights {s.weight_formats}; KV cache {s.kv_cache_dtype or 'unknown'}",
            f"kernels: {s.kernels}; batch invariance {_on(s.batch_invariant)}; zero-overhead scheduling "
            f"{_on(s.zos)}; CUDA graphs {s.cuda_graphs}",
            f"KV cache: {tokens:,} tokens per rank ({s.kv_blocks_per_rank} blocks of {s.block_size}, "
            f"{_size(s.kv_cache_bytes_per_rank)}) + {s.state_slots_per_rank} state slots "
            f"({_size(s.state_bytes_per_rank)}); {tokens * s.dp_size:,} tokens in all",
            f"max_model_len {s.max_model_len} (model limit {s.model_max_len}): max concurrency "
            f"{per_rank_conc * s.dp_size:.2f} sequences at {s.max_model_len} tokens ({per_rank_conc:.2f} per rank: "
            f"KV cache {kv_conc:.2f}x, {s.state_slots_per_rank} state slots, --max-num-seqs {s.max_num_seqs})",
        ]
    lines.append(f"listening on {url} (OpenAI API under /v1, Prometheus metrics at /metrics)")
    return lines
