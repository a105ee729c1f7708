"""Named model presets for ``make-checkpoint``: Hugging Face style ``config.json`` dicts.

A preset fixes the architecture; the values that depend on the tokenizer (vocabulary size,
bos/eos/pad ids, the Engram compressed vocabulary) are read from the tokenizer the checkpoint
ships with, so config and tokenizer can never disagree. The schema is the one of the official
checkpoint (``architectures``, ``model_type: deepseek_v41``, ``quantization_config``,
``text_config``), as in ``shared/golden/v41/checkpoint/config.json``.

Presets: ``tiny`` (the golden layout, a few MB); ``v41-flash`` (the published DeepSeek-V4.1-Flash
text backbone, without the DSpark draft layers); ``v41-flash-L8`` (the same widths and all 384
experts in 8 layers that still hold every layer role, for single-GPU runs at real width). The two
real-width presets are meant for ``make-checkpoint --config-only`` plus dummy weights; their
Engram tables are shrunk for such loads with ``shrink_engram``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any, Callable

from tokenizers import Tokenizer

from .config import V41Config
from .engram_token_map import build_compressed_token_map
from .tokenizer_builder import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN

logger = logging.getLogger(__name__)

# The official FP8 recipe: e4m3 dense weights with one UE8M0 scale per 32x32 tile, routed
# experts in FP4 (e2m1 with UE8M0 scales per 32 along K), activations quantized on the fly.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# The golden reference's tiny layout (every V4.1 feature, 6 layers, 256 wide), with a vocabulary
# large enough for a real BPE tokenizer and a context long enough to serve.
_TINY_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 32,
    },
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 16,
    "compress_ratios": [0, 2, 2, 1, 1, 1],
    "compress_rope_theta": 160000.0,
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 8,
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [0, 1],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 100,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "num_nextn_predict_layers": 0,
}

# DeepSeek-V4.1-Flash's text_config (shared/research/v41-architecture.md, section 1): 20 encoder
# and 20 decoder layers; only the backbone, so num_nextn_predict_layers is 0 and compress_ratios
# has no entries for the DSpark draft layers.
_V41_FLASH_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "moe_intermediate_size": 2304,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "compress_rope_theta": 160000.0,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "num_nextn_predict_layers": 0,
}

# V4.1-Flash widths in 8 layers, one of each role (SWA_ONLY 0-1, KV_INDEX_SOURCE 2,
# CONSUMER_RATIO2 3, CANDIDATE_SOURCE 4, CONSUMER_RATIO1 5 and 7, CANDIDATE_INDEX_SOURCE 6), with
# Engram on an SWA layer and on a ratio-2 KV source, like the real model's layers 1 and 14.
_V41_FLASH_L8_TEXT: dict[str, Any] = {
    **_V41_FLASH_TEXT,
    "num_hidden_layers": 8,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 6],
    "candidate_source_layer_id": 4,
    "engram_layer_ids": [1, 2],
}

# engram_vocab_size for dummy loads: ~4.8M rows per Engram layer (1.2 GB in FP8) instead of ~384M
# (98 GB); only the hash moduli change, every shape other than the table's rows stays real.
DUMMY_ENGRAM_VOCAB_SIZE = 200_000


def is_prime(n: int) -> bool:
    """Deterministic trial division; Engram bucket counts are small (at most a few million)."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    divisor = 3
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 2
    return True


def engram_bucket_primes(layer_ids: list[int], max_ngram_size: int, vocab_size: int,
                         n_heads: int) -> list[list[int]]:
    """The hash-table size of every (n-gram size, head) of every Engram layer, as the reference picks them.

    One set of used primes is shared by all layers, so no two hash heads anywhere in the model
    have the same modulus. For each layer and each n = 2..max_ngram_size the search restarts at
    ``vocab_size - 1`` and takes the next ``n_heads`` unused primes above the running value.
    Returns, per layer, the primes in (n, head) order; a layer's table has ``sum`` of them rows.
    """
    used: set[int] = set()
    per_layer: list[list[int]] = []
    for _ in layer_ids:
        primes: list[int] = []
        for _n in range(2, max_ngram_size + 1):
            candidate = vocab_size - 1
            for _head in range(n_heads):
                candidate += 1
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                primes.append(candidate)
        per_layer.append(primes)
    return per_layer


def engram_num_embeddings(text_config: dict[str, Any]) -> list[int]:
    """Rows of each Engram layer's table: the sum of that layer's bucket primes."""
    primes = engram_bucket_primes(
        list(text_config["engram_layer_ids"]),
        int(text_config["engram_max_ngram_size"]),
        int(text_config["engram_vocab_size"]),
        int(text_config["engram_n_heads"]),
    )
    return [sum(layer_primes) for layer_primes in primes]


def shrink_engram(text_config: dict[str, Any], vocab_size: int = DUMMY_ENGRAM_VOCAB_SIZE) -> dict[str, Any]:
    """A copy of ``text_config`` whose Engram tables start their buckets at ``vocab_size``.

    The real tables (``engram_vocab_size`` 16M, ~197 GB together) cannot be made up on a device
    for a dummy load; lowering the bucket start shrinks every table consistently, because the
    hasher derives its moduli from the same ``engram_vocab_size``. A config already at or below
    ``vocab_size`` (or without Engram) is returned unchanged.
    """
    text = copy.deepcopy(text_config)
    if not text.get("engram_layer_ids") or int(text["engram_vocab_size"]) <= vocab_size:
        return text
    before = engram_num_embeddings(text)
    text["engram_vocab_size"] = vocab_size
    text["engram_num_embeddings"] = engram_num_embeddings(text)
    logger.info("Engram tables shrunk from %d to %d rows for the dummy load (engram_vocab_size %s -> %d)",
                sum(before), sum(text["engram_num_embeddings"]), text_config["engram_vocab_size"], vocab_size)
    return text


def shrink_engram_config(cfg: V41Config, vocab_size: int = DUMMY_ENGRAM_VOCAB_SIZE) -> V41Config:
    """``shrink_engram`` for a resolved config: the same fields changed, layer roles re-derived."""
    text = shrink_engram({"engram_layer_ids": list(cfg.engram_layer_ids),
                          "engram_max_ngram_size": cfg.engram_max_ngram_size,
                          "engram_vocab_size": cfg.engram_vocab_size,
                          "engram_n_heads": cfg.engram_num_heads}, vocab_size)
    if text["engram_vocab_size"] == cfg.engram_vocab_size:
        return cfg
    shrunk = dataclasses.replace(cfg, engram_vocab_size=text["engram_vocab_size"],
                                 engram_num_embeddings=tuple(text["engram_num_embeddings"]))
    return shrunk.with_roles()


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token!r} token")
    return token_id


def _config_from_text(text_defaults: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """Fill the tokenizer-dependent fields of a preset and wrap it in the HF top-level schema."""
    text = copy.deepcopy(text_defaults)
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size != text["vocab_size"]:
        raise ValueError(f"the preset needs a {text['vocab_size']}-token tokenizer, got {vocab_size}")
    bos_id = _special_id(tokenizer, BOS_TOKEN)
    eos_id = _special_id(tokenizer, EOS_TOKEN)
    pad_id = _special_id(tokenizer, PAD_TOKEN)
    _, compressed_vocab_size = build_compressed_token_map(tokenizer)
    text["engram_num_embeddings"] = engram_num_embeddings(text)
    text["engram_pad_token_id"] = pad_id
    text["engram_compressed_vocab_size"] = compressed_vocab_size
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
        "text_config": text,
    }


def tiny_preset(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tiny`` preset (about 5 MB of weights) for the given 1024-token tokenizer."""
    return _config_from_text(_TINY_TEXT, tokenizer)


_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": _TINY_TEXT,
    "v41-flash": _V41_FLASH_TEXT,
    "v41-flash-L8": _V41_FLASH_L8_TEXT,
}
PRESETS: dict[str, Callable[[Tokenizer], dict[str, Any]]] = {
    name: functools.partial(_config_from_text, text) for name, text in _TEXT_CONFIGS.items()
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_vocab_size(name: str) -> int:
    """The tokenizer size a preset is built for (the tokenizer is trained to exactly this size)."""
    _check_name(name)
    return int(_TEXT_CONFIGS[name]["vocab_size"])


def preset_config(name: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The HF-style config dict of preset ``name`` for ``tokenizer``."""
    _check_name(name)
    return PRESETS[name](tokenizer)


def _check_name(name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
