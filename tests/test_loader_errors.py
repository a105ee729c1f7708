"""Loading a checkpoint: clear errors for broken checkpoints, sharded files, ignored extra tensors.

Broken checkpoints are copies of the tiny checkpoint with one thing changed (tensors rewritten
with ``safetensors.torch.save_file``, JSON files edited).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import ConfigError, V41Config, WeightFormat
from model.loader import CheckpointError, CheckpointReader, load_model, validate_checkpoint
from model.transformer import ModelOptions, V41Model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_tensors(tiny_checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_checkpoint / "model.safetensors"))


def copy_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None,
                    config: Callable[[dict], None] | None = None,
                    token_map: Callable[[dict], None] | None = None) -> Path:
    """A copy of ``src`` with its weights replaced by ``tensors`` and its JSON files edited."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    for name, edit in (("config.json", config), ("engram_token_map.json", token_map)):
        if edit is not None:
            document = json.loads((dst / name).read_text())
            edit(document)
            (dst / name).write_text(json.dumps(document))
    return dst


def prefill_logits(model: V41Model, tokens: list[int], one_sequence) -> torch.Tensor:
    return one_sequence(model, len(tokens)).logits(tokens, all_rows=True)


# ----------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("name", ["layers.2.attn.wq_b.scale", "head.weight", "layers.3.attn.indexer.wk.weight",
                                  "layers.5.ffn.experts.3.w2.weight"])
def test_missing_tensor_is_named(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path, name: str) -> None:
    tensors = {k: v for k, v in tiny_tensors.items() if k != name}
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) .*{re.escape(name)}"):
        load_model(path)


def test_many_missing_tensors_are_summarised(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path) -> None:
    tensors = {k: v for k, v in tiny_tensors.items() if not k.startswith("layers.4.")}
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError, match=r"layers\.4\..*\(and \d+ more\)"):
        load_model(path)


@pytest.mark.parametrize("name,new_dtype,stored,expected", [
    ("layers.4.ffn_norm.weight", torch.float32, "F32", "BF16"),
    ("layers.0.attn.wkv.weight", torch.bfloat16, "BF16", "F8_E4M3"),  # an FP8 weight stored unquantized
    ("layers.1.attn.wkv.scale", torch.float32, "F32", "F8_E8M0"),
    ("layers.2.ffn.experts.0.w1.weight", torch.uint8, "U8", "I8"),
    ("layers.1.attn.attn_sink", torch.bfloat16, "BF16", "F32"),
])
def test_wrong_dtype_is_named(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path, name: str,
                              new_dtype: torch.dtype, stored: str, expected: str) -> None:
    tensors = dict(tiny_tensors)
    tensors[name] = tensors[name].float().to(new_dtype) if new_dtype.is_floating_point else tensors[name].view(new_dtype)
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} has dtype {stored}, expected {expected}"):
        load_model(path)


@pytest.mark.parametrize("name,reshape", [
    ("norm.weight", lambda t: t[:-32]),
    ("layers.3.attn.indexer.wk.weight", lambda t: t[:, :32]),
    ("layers.0.engram.embed.scale", lambda t: t[:-1]),
    ("layers.1.hc_attn_fn", lambda t: t.t()),
    ("embed.weight", lambda t: t.reshape(-1, 128)),
])
def test_wrong_shape_is_named(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path, name: str, reshape) -> None:
    tensors = dict(tiny_tensors)
    expected = list(tensors[name].shape)
    tensors[name] = reshape(tensors[name]).contiguous()
    got = list(tensors[name].shape)
    assert got != expected
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} has shape {re.escape(str(got))}, "
                                              rf"expected {re.escape(str(expected))}"):
        load_model(path)


# ----------------------------------------------------------------------------- config
def test_unknown_model_type(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", config=lambda c: c.update(model_type="deepseek_v3"))
    with pytest.raises(ConfigError, match=r"model_type is 'deepseek_v3'.*deepseek_v41"):
        load_model(path)


@pytest.mark.parametrize("key", ["sliding_window", "hidden_size", "compress_ratios", "n_routed_experts"])
def test_missing_text_config_key(tiny_checkpoint: Path, tmp_path: Path, key: str) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", config=lambda c: c["text_config"].pop(key))
    with pytest.raises(ConfigError, match=rf"text_config\.{key} is missing"):
        load_model(path)


def test_missing_text_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", config=lambda c: c.pop("text_config"))
    with pytest.raises(ConfigError, match="text_config"):
        load_model(path)


def test_missing_config_json(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_model(path)


# ----------------------------------------------------------------------------- Engram token map
def test_token_map_size_disagreeing_with_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # the map itself stays consistent (all ids below its size); only the sizes disagree
    def grow(m: dict) -> None:
        m["compressed_vocab_size"] += 1

    path = copy_checkpoint(tiny_checkpoint, tmp_path / "map", token_map=grow)
    size = json.loads((path / "engram_token_map.json").read_text())["compressed_vocab_size"]
    configured = json.loads((path / "config.json").read_text())["text_config"]["engram_compressed_vocab_size"]
    with pytest.raises(CheckpointError, match=rf"{size} compressed ids.*engram_compressed_vocab_size={configured}"):
        load_model(path)


def test_config_compressed_vocab_disagreeing_with_token_map(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "cfg",
                           config=lambda c: c["text_config"].update(engram_compressed_vocab_size=300))
    with pytest.raises(CheckpointError, match=r"engram_compressed_vocab_size=300"):
        load_model(path)


def test_token_map_pad_id_disagreeing_with_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    pad = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]["engram_pad_token_id"]
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "cfg",
                           config=lambda c: c["text_config"].update(engram_pad_token_id=pad + 1))
    with pytest.raises(CheckpointError, match=rf"pad id {pad} != config {pad + 1}"):
        load_model(path)


def test_missing_token_map_and_tokenizer(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (path / "engram_token_map.json").unlink()
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="engram_token_map.json or tokenizer.json"):
        load_model(path)


# ----------------------------------------------------------------------------- layouts that load
def shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Split the weights into two shard files listed in model.safetensors.index.json."""
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):  # interleaved: every layer spans both files
        save_file({n: tensors[n].contiguous() for n in part}, str(path / files[i]))
        weight_map.update({n: files[i] for n in part})
    (path / "model.safetensors").unlink()
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_sharded_checkpoint_loads_with_identical_logits(tiny_checkpoint: Path, tiny_tensors, tiny_model: V41Model,
                                                        tmp_path: Path, one_sequence, random_tokens) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "sharded")
    weight_map = shard(path, tiny_tensors)
    assert len(set(weight_map.values())) == 2 and not (path / "model.safetensors").exists()
    sharded = load_model(path, ModelOptions())
    tokens = random_tokens(tiny_model.cfg.vocab_size, 40, seed=1)
    expected = prefill_logits(tiny_model, tokens, one_sequence)
    assert torch.equal(prefill_logits(sharded, tokens, one_sequence), expected)


def test_index_naming_a_missing_shard(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "sharded")
    shard(path, tiny_tensors)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002\.safetensors .*missing"):
        load_model(path)


def test_no_weights_at_all(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(path)


def test_extra_mtp_and_vision_tensors_are_ignored_with_info_log(tiny_checkpoint: Path, tiny_tensors,
                                                                tiny_model: V41Model, tmp_path: Path, caplog,
                                                                one_sequence, random_tokens) -> None:
    tensors = dict(tiny_tensors)
    tensors["mtp.0.embed.weight"] = torch.randn(8, 256).bfloat16()
    tensors["mtp.0.attn.wq_a.weight"] = torch.randn(64, 256).to(torch.float8_e4m3fn)
    tensors["vision.patch_embed.weight"] = torch.randn(16, 3, 2, 2)
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "extra", tensors)
    with caplog.at_level(logging.INFO, logger="model.loader"):
        model = load_model(path, ModelOptions())
    ignored = [r for r in caplog.records if r.name == "model.loader" and "vision/DSpark" in r.getMessage()]
    assert len(ignored) == 1 and ignored[0].levelno == logging.INFO
    assert "ignoring 3 " in ignored[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "known extras must not warn"
    tokens = random_tokens(tiny_model.cfg.vocab_size, 20, seed=2)
    assert torch.equal(prefill_logits(model, tokens, one_sequence), prefill_logits(tiny_model, tokens, one_sequence))


def test_unknown_extra_tensors_are_warned_about(tiny_checkpoint: Path, tiny_tensors, tmp_path: Path,
                                                caplog) -> None:
    tensors = dict(tiny_tensors)
    tensors["layers.0.attn.surprise"] = torch.zeros(4)
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "extra", tensors)
    with caplog.at_level(logging.INFO, logger="model.loader"):
        validate_checkpoint(V41Config.from_pretrained(path), CheckpointReader(path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "layers.0.attn.surprise" in warnings[0]


def test_token_map_covering_too_few_ids(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def truncate(m: dict) -> None:
        m["token_map"], m["vocab_size"] = m["token_map"][:100], 100

    path = copy_checkpoint(tiny_checkpoint, tmp_path / "map", token_map=truncate)
    with pytest.raises(CheckpointError, match=r"covers 100 of 1024 token ids"):
        load_model(path)


# ----------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("corruption", ["id-out-of-range", "not-json"])
def test_corrupt_token_map_is_a_checkpoint_error(tiny_checkpoint: Path, tmp_path: Path, corruption: str) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "map")
    map_file = path / "engram_token_map.json"
    if corruption == "not-json":
        map_file.write_text("{not json")
    else:
        m = json.loads(map_file.read_text())
        m["token_map"][5] = m["compressed_vocab_size"] + 3
        map_file.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="engram_token_map.json"):
        load_model(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(tiny_checkpoint: Path, tmp_path: Path,
                                                                    damage: str) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_overrides_replace_config_values(tiny_checkpoint: Path) -> None:
    """``--hf-overrides``: a text_config key, a dict merged into the one it replaces, a top-level key."""
    cfg = V41Config.from_pretrained(tiny_checkpoint, {
        "num_hidden_layers": 4, "rope_scaling": {"factor": 2.0},
        "quantization_config": {"expert_dtype": "fp8"}})
    plain = V41Config.from_pretrained(tiny_checkpoint)
    assert (cfg.num_layers, len(cfg.roles), cfg.rope_factor, cfg.expert_format) == (4, 4, 2.0, WeightFormat.FP8)
    assert (cfg.beta_fast, cfg.dense_format) == (plain.beta_fast, plain.dense_format)  # the rest of each dict kept
    assert cfg.roles == plain.roles[:4]


@pytest.mark.parametrize("overrides, message", [
    ({"num_hidden_layer": 4}, r"cannot override 'num_hidden_layer': config.json has no such key; "
                              r"did you mean 'num_hidden_layers'"),
    ({"num_hidden_layers": 7}, r"with the overrides \{\"num_hidden_layers\": 7\}: compress_ratios has 6 entries "
                               r"for 7 layers"),
    ({"compress_ratios": [0, 3, 2, 1, 1, 1]}, r"layer 1: compress ratio 3"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be >= 1"),
    ({"num_hidden_layers": 3}, r"candidate_source_layer_id=3 is past the last of the 3 layers \(with fewer layers, "
                               r"name one of the index source layers left, or -1 for none\)"),
    ({"n_routed_experts": 1}, r"num_experts_per_tok=2 must be between 1 and n_routed_experts=1"),
    ({"num_hidden_layers": "four"}, r"a value of text_config has the wrong type \(invalid literal"),
    ({"rope_scaling": 2}, r"a value of text_config has the wrong type"),
    ({"quantization_config": [32, 32]}, r"quantization_config must be an object"),
])
def test_overrides_the_model_cannot_take_are_errors_naming_them(tiny_checkpoint: Path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        V41Config.from_pretrained(tiny_checkpoint, overrides)


def test_overrides_leave_a_real_checkpoints_tensors_to_the_loaders_checks(tiny_checkpoint: Path) -> None:
    """Fewer experts than the checkpoint's routers score: the loader names the shape that disagrees."""
    with pytest.raises(CheckpointError, match=r"gate\.weight"):
        load_model(tiny_checkpoint, hf_overrides={"n_routed_experts": 2})
