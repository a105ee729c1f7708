"""Dummy weights: the made-up checkpoint matches the weight spec, is deterministic per name and
has the statistics of make-checkpoint's initialisers."""

from __future__ import annotations

import random

import pytest
import torch

from model.checkpoint_maker import GAINS, NORM_MEANS
from model.config import V41Config
from model.dummy_weights import DummyCheckpointReader, tensor_seed
from model.loader import validate_checkpoint
from model.presets import preset_config, shrink_engram_config
from model.quant import dequantize_fp4_weight, dequantize_fp8_rows, dequantize_fp8_weight
from model.tokenizer_builder import train_tokenizer


@pytest.fixture(scope="module")
def cfg() -> V41Config:
    return V41Config.from_hf_dict(preset_config("tiny", train_tokenizer(1024)))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def test_every_tensor_matches_its_spec_and_the_loader_accepts_it(cfg: V41Config) -> None:
    reader = DummyCheckpointReader(cfg, "cpu")
    validate_checkpoint(cfg, reader)
    for name in reader.names():
        tensor = reader.get(name)
        dtype, shape = reader.dtype_and_shape(name)
        assert tuple(tensor.shape) == shape, name
        assert {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}[dtype] == tensor.dtype, name
        assert tensor.device.type == "cpu"
    assert not reader._waiting  # every scale was handed out, nothing is kept


def test_same_name_same_tensor_in_any_order(cfg: V41Config) -> None:
    first = DummyCheckpointReader(cfg, "cpu", seed=5)
    names = first.names()
    made = {name: _bytes(first.get(name)) for name in names}
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)  # scales now often come before their weights
    second = DummyCheckpointReader(cfg, "cpu", seed=5)
    for name in shuffled:
        assert torch.equal(_bytes(second.get(name)), made[name]), name
    w = "layers.2.ffn.experts.1.w2.weight"
    assert torch.equal(_bytes(second.get(w)), made[w])  # asked again: made again, identically
    other_seed = DummyCheckpointReader(cfg, "cpu", seed=6)
    assert not torch.equal(_bytes(other_seed.get(w)), made[w])
    assert tensor_seed(5, w) != tensor_seed(6, w) and tensor_seed(5, w) == tensor_seed(5, w)


def test_statistics_follow_the_initialisers(cfg: V41Config) -> None:
    reader = DummyCheckpointReader(cfg, "cpu")
    checked = 0
    for name in reader.names():
        dtype, shape = reader.dtype_and_shape(name)
        if dtype not in ("F8_E4M3", "I8"):
            continue
        values = reader.get(name)
        scale = reader.get(name.removesuffix(".weight") + ".scale")
        module = name.split(".")[-2]
        if ".engram.embed." in name:
            restored, expected = dequantize_fp8_rows(values, scale), 1.0
        elif dtype == "F8_E4M3":
            restored, expected = dequantize_fp8_weight(values, scale), GAINS.get(module, 1.0) * shape[1] ** -0.5
            tiles = values.float().view(shape[0] // 32, 32, shape[1] // 32, 32).abs().amax(dim=(1, 3))
            assert tiles.min() >= 224 and tiles.max() <= 448, name  # smallest scale per 32x32 tile
        else:
            restored = dequantize_fp4_weight(values, scale)
            expected = GAINS.get(module, 1.0) * (shape[1] * 2) ** -0.5
        std = restored.float().std().item()
        assert expected / 2 < std < expected * 2, (name, std, expected)
        checked += 1
    assert checked > 50
    assert abs(reader.get("embed.weight").float().pow(2).mean().sqrt().item() - 0.12) < 0.01
    assert abs(reader.get("layers.0.ffn_norm.weight").float().mean().item() - NORM_MEANS["ffn_norm"]) < 0.02
    packed = reader.get("layers.0.ffn.experts.0.w1.weight").view(torch.uint8)
    codes = torch.cat([packed & 0x0F, packed >> 4]).flatten().long()
    assert torch.bincount(codes, minlength=16).min() > 0.8 * codes.numel() / 16  # uniform E2M1 codes


def test_real_width_shapes_without_allocating_the_model() -> None:
    """The 8-layer real-width preset: the spec and the reader agree on every tensor (no weights made)."""
    cfg = shrink_engram_config(V41Config.from_hf_dict(preset_config("v41-flash-L8", train_tokenizer(129280))), 300)
    reader = DummyCheckpointReader(cfg, "cpu")
    validate_checkpoint(cfg, reader)
    assert len(reader.names()) > 8 * 384 * 6
    w1 = reader.get("layers.3.ffn.experts.383.w1.weight")
    assert w1.shape == (2304, 2560) and w1.dtype == torch.int8
    assert reader.get("layers.3.ffn.experts.383.w1.scale").shape == (2304, 160)
    table = reader.get("layers.2.engram.embed.weight")
    assert table.shape == (cfg.engram_num_embeddings[1], 256) and table.dtype == torch.float8_e4m3fn


def test_the_dummy_routers_spread_a_batch_like_uniform_routing() -> None:
    """Zero router biases (the module's docstring): at the real widths, 64 tokens of unit-RMS hidden
    states through a layer's ``ffn_norm`` and router hit about as many distinct experts as uniform
    routing would (~244 of 384); make-checkpoint's random biases would send them to ~30."""
    from model.routing import RoutingRule, route

    cfg = shrink_engram_config(V41Config.from_hf_dict(preset_config("v41-flash-L8", train_tokenizer(129280))), 300)
    reader = DummyCheckpointReader(cfg, "cpu")
    bias = reader.get("layers.3.ffn.gate.bias")
    assert bias.dtype == torch.float32 and bias.shape == (384,) and not bias.any()
    weight = reader.get("layers.3.ffn.gate.weight").float()
    norm = reader.get("layers.3.ffn_norm.weight").float()
    h = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = (h / h.pow(2).mean(-1, keepdim=True).sqrt() * norm).bfloat16().float()
    rule = RoutingRule(6, "sqrtsoftplus", True, 1.5, 1.0)
    uniform = 384 * (1 - (1 - 6 / 384) ** 64)
    assert route(x @ weight.T, bias, rule)[1].unique().numel() > 0.9 * uniform
    skewed = torch.randn(384, generator=torch.Generator().manual_seed(1)) * 0.5  # make-checkpoint's statistics
    assert route(x @ weight.T, skewed, rule)[1].unique().numel() < 0.3 * uniform
