"""The tensors a DeepSeek-V4.1 checkpoint holds, in the official layout, for a given config.

One table drives both directions: the loader checks a checkpoint against it (clear errors for a
missing tensor or a wrong shape/dtype) and ``make-checkpoint`` writes exactly these tensors.
Names are the reference module paths (no ``model.`` prefix); dtypes are safetensors dtype names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import V41Config, WeightFormat

# Tensors in an official checkpoint that the text backbone does not use.
IGNORED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")
IGNORED_SUFFIXES = ("ffn.gate.bias_vl",)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: BF16, F32, F8_E4M3, F8_E8M0, I8
    kind: str  # what it is, for make-checkpoint's initialiser: see ``quantized_kind``


def _ceil32(n: int) -> int:
    return (n + 31) // 32


def _linear(specs: dict, name: str, out_f: int, in_f: int, fmt: WeightFormat, kind: str) -> None:
    """A projection ``[out, in]`` stored in ``fmt``, with its scale tensor when quantized."""
    if fmt is WeightFormat.FP8:
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f), "F8_E4M3", kind)
        specs[f"{name}.scale"] = TensorSpec((_ceil32(out_f), _ceil32(in_f)), "F8_E8M0", "scale")
    elif fmt is WeightFormat.FP4:
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f // 2), "I8", kind)
        specs[f"{name}.scale"] = TensorSpec((out_f, in_f // 32), "F8_E8M0", "scale")
    else:
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f), "BF16", kind)


def checkpoint_tensors(cfg: V41Config) -> dict[str, TensorSpec]:
    """Every tensor of the text backbone, in a deterministic order (the order make-checkpoint uses)."""
    d, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    dense, experts = cfg.dense_format, cfg.expert_format
    mix = (2 + hc) * hc
    specs: dict[str, TensorSpec] = {"embed.weight": TensorSpec((cfg.vocab_size, d), "BF16", "embed")}
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        role = cfg.role(layer)
        if role.has_engram:
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
            ehd = cfg.engram_head_dim
            if dense is WeightFormat.BF16:
                specs[p + "engram.embed.weight"] = TensorSpec((rows, ehd), "BF16", "engram_table")
            else:
                specs[p + "engram.embed.weight"] = TensorSpec((rows, ehd), "F8_E4M3", "engram_table")
                specs[p + "engram.embed.scale"] = TensorSpec((rows, ehd // 32), "F8_E8M0", "scale")
            _linear(specs, p + "engram.wkv", d * (hc + 1), cfg.num_hash_columns * ehd, dense, "engram_wkv")
            specs[p + "engram.q_weight"] = TensorSpec((hc, d), "BF16", "engram_qk")
            specs[p + "engram.k_weight"] = TensorSpec((hc, d), "BF16", "engram_qk")
        a = p + "attn."
        specs[a + "attn_sink"] = TensorSpec((cfg.num_heads,), "F32", "vector")
        _linear(specs, a + "wq_a", cfg.q_lora_rank, d, dense, "wq_a")
        specs[a + "q_norm.weight"] = TensorSpec((cfg.q_lora_rank,), "BF16", "q_norm")
        _linear(specs, a + "wq_b", cfg.num_heads * hd, cfg.q_lora_rank, dense, "wq_b")
        _linear(specs, a + "wkv", hd, d, dense, "wkv")
        specs[a + "kv_norm.weight"] = TensorSpec((hd,), "BF16", "kv_norm")
        _linear(specs, a + "wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.num_heads * hd // cfg.o_groups, dense, "wo_a")
        _linear(specs, a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, dense, "wo_b")
        if role.owns_kv:
            specs[a + "compressor.wkv.weight"] = TensorSpec((hd, d), "BF16", "compressor")
            if role.compress_ratio > 1:
                specs[a + "compressor.wgate.weight"] = TensorSpec((hd, d), "BF16", "compressor")
            specs[a + "compressor.norm.weight"] = TensorSpec((hd,), "BF16", "compressor_norm")
            specs[a + "indexer.wk.weight"] = TensorSpec((cfg.index_head_dim, hd), "BF16", "indexer_wk")
            specs[a + "indexer.k_norm.weight"] = TensorSpec((cfg.index_head_dim,), "BF16", "k_norm")
        if role.runs_indexer:
            _linear(specs, a + "indexer.wq_b", cfg.index_num_heads * cfg.index_head_dim, cfg.q_lora_rank,
                    dense, "indexer_wq_b")
            specs[a + "indexer.weights_proj.weight"] = TensorSpec((cfg.index_num_heads, d), "BF16", "weights_proj")
        f = p + "ffn."
        specs[f + "gate.weight"] = TensorSpec((cfg.num_routed_experts, d), "BF16", "gate")
        specs[f + "gate.bias"] = TensorSpec((cfg.num_routed_experts,), "F32", "gate_bias")
        inter = cfg.moe_intermediate_size
        for e in range(cfg.num_routed_experts):
            _linear(specs, f"{f}experts.{e}.w1", inter, d, experts, "w1")
            _linear(specs, f"{f}experts.{e}.w2", d, inter, experts, "w2")
            _linear(specs, f"{f}experts.{e}.w3", inter, d, experts, "w3")
        _linear(specs, f + "shared_experts.w1", inter, d, dense, "w1")
        _linear(specs, f + "shared_experts.w2", d, inter, dense, "w2")
        _linear(specs, f + "shared_experts.w3", inter, d, dense, "w3")
        specs[p + "attn_norm.weight"] = TensorSpec((d,), "BF16", "attn_norm")
        specs[p + "ffn_norm.weight"] = TensorSpec((d,), "BF16", "ffn_norm")
        for sub in ("attn", "ffn"):
            specs[f"{p}hc_{sub}_fn"] = TensorSpec((mix, hc * d), "F32", "hc_fn")
            specs[f"{p}hc_{sub}_base"] = TensorSpec((mix,), "F32", "vector")
            specs[f"{p}hc_{sub}_scale"] = TensorSpec((3,), "F32", "vector")
    specs["norm.weight"] = TensorSpec((d,), "BF16", "final_norm")
    specs["head.weight"] = TensorSpec((cfg.vocab_size, d), "BF16", "head")
    return specs


def is_ignored(name: str) -> bool:
    """Tensors of the vision tower and the DSpark draft head: present in official checkpoints, unused."""
    return name.startswith(IGNORED_PREFIXES) or name.endswith(IGNORED_SUFFIXES)
