"""The real-size presets (v41-flash, v41-flash-L8), their 129280-token tokenizer, Engram shrinking
and ``make-checkpoint --config-only``. Nothing here makes real-size weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from model.config import V41Config
from model.engram_token_map import build_compressed_token_map, load_token_map
from model.presets import (
    DUMMY_ENGRAM_VOCAB_SIZE,
    engram_bucket_primes,
    preset_config,
    preset_names,
    shrink_engram,
    shrink_engram_config,
)
from model.tokenizer_builder import RESERVED_TOKEN, SPECIAL_TOKENS, train_tokenizer

ALL_BLOCK_TYPES = {"SWA_ONLY", "KV_INDEX_SOURCE", "CONSUMER_RATIO2", "CANDIDATE_SOURCE", "CONSUMER_RATIO1",
                   "CANDIDATE_INDEX_SOURCE"}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(129280)


@pytest.fixture(scope="module")
def configs(tokenizer) -> dict[str, dict]:
    return {name: preset_config(name, tokenizer) for name in ("v41-flash", "v41-flash-L8")}


def test_tokenizer_reaches_the_real_vocabulary(tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 129280
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tokenizer.id_to_token(129279).startswith("<|reserved_")
    assert tokenizer.token_to_id(RESERVED_TOKEN.format(0)) < 2300  # fillers follow the ~2.2k learned tokens
    assert "<|reserved_" not in train_tokenizer(1024).to_str()  # the tiny tokenizer has no filler
    text = "The keeper said hello <|reserved_7|> world"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<|reserved_7|>") in ids
    assert tokenizer.decode(ids) == text  # filler tokens are visible text, not skipped specials
    lookup, compressed = build_compressed_token_map(tokenizer)
    assert len(lookup) == 129280 and compressed > 120000


def test_v41_flash_is_the_published_config(configs) -> None:
    raw = configs["v41-flash"]
    text = raw["text_config"]
    cfg = V41Config.from_hf_dict(raw)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_head_dim) == (40, 5120, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups, cfg.sliding_window) == (1280, 1024, 8, 128)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20) and cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (cfg.candidate_source_layer_id, cfg.candidate_topk_blocks, cfg.candidate_block_size) == (20, 2048, 8)
    assert (cfg.index_num_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 512)
    assert (cfg.num_routed_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size) == (384, 6, 2304)
    assert (cfg.scoring_func, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.norm_topk_prob) == (
        "sqrtsoftplus", 1.5, 10.0, True)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps) == (4, 20, 1e-6, 1e-20)
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_max_position_embeddings) == (
        10000, 160000, 16, 65536)
    assert (cfg.beta_fast, cfg.beta_slow, cfg.max_position_embeddings) == (32, 1, 1048576)
    assert cfg.engram_layer_ids == (1, 14) and cfg.engram_vocab_size == 16000000
    assert cfg.engram_num_embeddings == (384006168, 384016682)  # the published table sizes
    assert (cfg.engram_max_ngram_size, cfg.engram_num_heads, cfg.engram_head_dim, cfg.engram_pad_token_id) == (
        4, 8, 256, 2)
    assert cfg.vocab_size == 129280 and text["num_nextn_predict_layers"] == 0
    types = [role.block_type for role in cfg.roles]
    assert types[20] == "CANDIDATE_SOURCE" and types[24] == "CANDIDATE_INDEX_SOURCE" and types[39] == "CONSUMER_RATIO1"
    assert set(types) == ALL_BLOCK_TYPES


def test_l8_keeps_every_layer_role(configs) -> None:
    cfg = V41Config.from_hf_dict(configs["v41-flash-L8"])
    full = V41Config.from_hf_dict(configs["v41-flash"])
    assert [role.block_type for role in cfg.roles] == [
        "SWA_ONLY", "SWA_ONLY", "KV_INDEX_SOURCE", "CONSUMER_RATIO2", "CANDIDATE_SOURCE", "CONSUMER_RATIO1",
        "CANDIDATE_INDEX_SOURCE", "CONSUMER_RATIO1"]
    assert cfg.num_routed_experts == 384 and cfg.hidden_size == full.hidden_size
    assert [cfg.role(i).block_type for i in cfg.engram_layer_ids] == [full.role(i).block_type
                                                                       for i in full.engram_layer_ids]
    assert cfg.role(7).topk_source == 6 and cfg.role(5).topk_source == 4 and cfg.role(3).kv_source == 2


def test_shrink_engram(configs, caplog) -> None:
    text = configs["v41-flash-L8"]["text_config"]
    with caplog.at_level(logging.INFO, logger="model.presets"):
        small = shrink_engram(text)
    assert "Engram tables shrunk from 768022850" in caplog.text
    assert text["engram_vocab_size"] == 16000000  # the preset itself is untouched
    assert small["engram_vocab_size"] == DUMMY_ENGRAM_VOCAB_SIZE
    primes = engram_bucket_primes([1, 2], 4, DUMMY_ENGRAM_VOCAB_SIZE, 8)
    assert small["engram_num_embeddings"] == [sum(p) for p in primes]
    assert all(4_700_000 < rows < 4_900_000 for rows in small["engram_num_embeddings"])
    cfg = V41Config.from_hf_dict(configs["v41-flash-L8"])
    shrunk = shrink_engram_config(cfg)
    assert shrunk.engram_num_embeddings == tuple(small["engram_num_embeddings"])
    assert [r.block_type for r in shrunk.roles] == [r.block_type for r in cfg.roles]
    assert shrink_engram_config(shrunk) is shrunk and shrink_engram(small) == small


def test_config_only_writes_no_weights(tmp_path: Path, capsys) -> None:
    from deploy.cli import main

    out = tmp_path / "l8"
    assert main(["make-checkpoint", str(out), "--preset", "v41-flash-L8", "--config-only"]) == 0
    assert "without weights" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "engram_token_map.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    cfg = V41Config.from_pretrained(out)
    assert cfg.num_layers == 8 and cfg.vocab_size == 129280
    token_map = load_token_map(out / "engram_token_map.json")
    assert token_map.vocab_size == 129280 and token_map.compressed_vocab_size == cfg.engram_compressed_vocab_size
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 1048576
    assert {"tiny", "v41-flash", "v41-flash-L8"} <= set(preset_names())
