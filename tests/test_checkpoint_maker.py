"""make-checkpoint: determinism, layout, weight statistics, Engram token map, tokenizer, default model."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2.sandbox
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.checkpoint_maker import (
    CHECKPOINT_FILES,
    DEFAULT_MODEL_NAME,
    GAINS,
    default_model_dir,
    make_checkpoint,
    power_of_two_ceil,
    quantize_fp8,
)
from model.config import V41Config
from model.quant import dequantize_fp4_weight, dequantize_fp8_rows, dequantize_fp8_weight, pack_e2m1, unpack_e2m1
from model.engram_token_map import build_compressed_token_map, load_token_map, token_key, write_token_map
from model.presets import engram_bucket_primes, is_prime
from model.tokenizer_builder import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
from model.weight_spec import checkpoint_tensors

# The golden data sits next to the repository (``../shared/golden/v41``), as DESIGN.md describes.
GOLDEN_CHECKPOINT = Path(__file__).resolve().parents[2] / "shared" / "golden" / "v41" / "checkpoint"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(1024)


# ----------------------------------------------------------------- (a) determinism
def test_same_seed_gives_identical_files_and_other_seed_differs(checkpoint: Path, tmp_path: Path) -> None:
    again = make_checkpoint(tmp_path / "again", seed=0)
    for name in CHECKPOINT_FILES:
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name
    other = make_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (checkpoint / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()


def test_refuses_non_empty_directory_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_checkpoint(out)
    assert (out / "keep.txt").exists()
    make_checkpoint(out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no staging leftovers


# ----------------------------------------------------------------- (b) layout
def test_tensors_match_weight_spec_and_config_loads(checkpoint: Path) -> None:
    cfg = V41Config.from_pretrained(checkpoint)
    specs = checkpoint_tensors(cfg)
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert names == set(specs)
        for name, spec in specs.items():
            tensor_slice = handle.get_slice(name)
            assert tuple(tensor_slice.get_shape()) == spec.shape, name
            assert tensor_slice.get_dtype() == spec.dtype, name
    assert cfg.vocab_size == 1024 and cfg.num_layers == 6
    assert cfg.engram_num_embeddings == (660, 864)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.engram_pad_token_id) == (0, 1, 2)
    token_map = load_token_map(checkpoint / "engram_token_map.json")
    assert token_map.compressed_vocab_size == cfg.engram_compressed_vocab_size
    assert token_map.vocab_size == cfg.vocab_size
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1}


def test_engram_primes_follow_the_reference_layout() -> None:
    assert [n for n in range(60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    primes = engram_bucket_primes([0, 1], max_ngram_size=4, vocab_size=100, n_heads=2)
    assert primes == [[101, 103, 107, 109, 113, 127], [131, 137, 139, 149, 151, 157]]
    assert [sum(p) for p in primes] == [660, 864]


# ----------------------------------------------------------------- (c) number formats and statistics
def test_power_of_two_ceil_is_exact() -> None:
    x = torch.tensor([0.25, 0.3, 1.0, 1.0 + 2.0 ** -40, 3.0, 2.0 ** -120], dtype=torch.float64)
    assert power_of_two_ceil(x).tolist() == [0.25, 0.5, 1.0, 2.0, 4.0, 2.0 ** -120]


def test_quantize_fp8_handles_ragged_tiles() -> None:
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(3)) * 0.05
    values, scale = quantize_fp8(w)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (2, 3)
    restored = dequantize_fp8_weight(values, scale).float()
    assert torch.all((restored - w).abs() <= w.abs() * 2.0 ** -4 + scale.float().min() * 2.0 ** -9)


def test_fp8_weights_use_smallest_scale_and_requested_std(weights: dict[str, torch.Tensor]) -> None:
    checked = 0
    for name, values in weights.items():
        if values.dtype != torch.float8_e4m3fn:
            continue
        scale = weights[name.removesuffix(".weight") + ".scale"]
        table = ".engram.embed." in name
        rows, cols = (1, 32) if table else (32, 32)
        q = values.float()
        assert torch.isfinite(q).all(), name
        tiles = q.view(q.shape[0] // rows, rows, q.shape[1] // cols, cols).abs().amax(dim=(1, 3))
        # Smallest power of two with amax/scale <= 448 means every tile's largest |value| is in [224, 448].
        assert tiles.min() >= 224 and tiles.max() <= 448, name
        restored = dequantize_fp8_rows(values, scale) if table else dequantize_fp8_weight(values, scale)
        std = restored.float().std().item()
        module = name.split(".")[-2]
        expected = 1.0 if table else GAINS.get(module, 1.0) * values.shape[1] ** -0.5
        assert abs(std / expected - 1) < 0.06, (name, std, expected)
        checked += 1
    assert checked > 50


def test_fp4_packing_round_trips_and_expert_scales(weights: dict[str, torch.Tensor]) -> None:
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (8, 32)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert pack_e2m1(torch.tensor([[0x1, 0xA]], dtype=torch.uint8)).item() == 0xA1  # element 0 in the low nibble
    w1 = weights["layers.0.ffn.experts.0.w1.weight"]
    scale = weights["layers.0.ffn.experts.0.w1.scale"]
    assert w1.dtype == torch.int8 and scale.shape == (w1.shape[0], w1.shape[1] * 2 // 32)
    centre = round(math.log2(GAINS["w1"] * (w1.shape[1] * 2) ** -0.5 / 3.2))
    assert set(torch.log2(scale.float()).unique().tolist()) == {centre - 1.0, centre, centre + 1.0}
    assert 0.08 < dequantize_fp4_weight(w1, scale).float().std().item() < 0.16
    assert torch.bincount(unpack_e2m1(w1).flatten().long(), minlength=16).min() > 0.9 * w1.numel() * 2 / 16


def test_unquantized_statistics(weights: dict[str, torch.Tensor]) -> None:
    assert abs(weights["embed.weight"].float().pow(2).mean().sqrt().item() - 0.12) < 0.005
    assert abs(weights["layers.0.attn_norm.weight"].float().mean().item() - 0.025) < 0.002
    assert abs(weights["layers.3.attn.q_norm.weight"].float().mean().item() - 0.97) < 0.05
    assert abs(weights["norm.weight"].float().mean().item() - 1.0) < 0.03
    assert abs(weights["layers.2.ffn.gate.weight"].float().std().item() - 2.9 / 16) < 0.02
    assert abs(weights["head.weight"].float().std().item() - 1 / 16) < 0.003
    assert abs(weights["layers.0.engram.q_weight"].float().mean().item() - 1.0) < 0.03
    hc_fn = weights["layers.4.hc_ffn_fn"]
    assert hc_fn.dtype == torch.float32 and abs(hc_fn.std().item() - hc_fn.shape[1] ** -0.5) < 0.002


# ----------------------------------------------------------------- (d) Engram token map
class _DecodedTokenizer:
    """A stand-in with a fixed decoded string per id (the golden stub has no real tokenizer)."""

    def __init__(self, decoded: list[str]) -> None:
        self.decoded = decoded

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.decoded)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.decoded[i] for i in ids)

    def id_to_token(self, id: int) -> str:
        return self.decoded[id]


@pytest.mark.skipif(not GOLDEN_CHECKPOINT.is_dir(), reason="golden reference data not available")
def test_token_map_reproduces_the_golden_map(tmp_path: Path) -> None:
    stub = json.loads((GOLDEN_CHECKPOINT / "stub_tokenizer.json").read_text())["decoded"]
    golden = load_token_map(GOLDEN_CHECKPOINT / "engram_token_map.json")
    lookup, compressed = build_compressed_token_map(_DecodedTokenizer(stub))
    assert tuple(lookup) == golden.token_map and compressed == golden.compressed_vocab_size == 256
    write_token_map(tmp_path / "map.json", lookup, compressed, golden.pad_id)
    assert (tmp_path / "map.json").read_bytes() == (GOLDEN_CHECKPOINT / "engram_token_map.json").read_bytes()


def test_token_map_merges_exactly_the_equal_keys(tokenizer, checkpoint: Path) -> None:
    lookup, compressed = build_compressed_token_map(tokenizer)
    keys = [token_key(tokenizer.decode([i], skip_special_tokens=False), tokenizer.id_to_token(i))
            for i in range(tokenizer.get_vocab_size())]
    first_id_of_key: dict[str, int] = {}
    for token_id, key in enumerate(keys):
        assert lookup[token_id] == first_id_of_key.setdefault(key, lookup[token_id])
    assert len(first_id_of_key) == compressed == len(set(lookup)) == max(lookup) + 1
    assert compressed < tokenizer.get_vocab_size()  # case/space variants really are merged
    same = lambda a, b: lookup[tokenizer.token_to_id(a)] == lookup[tokenizer.token_to_id(b)]  # noqa: E731
    assert same("The", "ĠThe") and same("Ġthe", "ĠThe") and same("Ġ", "Ċ")
    assert not same("Ã", "Ä")  # partial UTF-8 bytes keep their own keys
    stored = load_token_map(checkpoint / "engram_token_map.json")
    assert stored.token_map == tuple(lookup) and stored.pad_id == 2
    assert stored.pad_compressed_id == lookup[2]


def test_token_map_json_round_trips(tmp_path: Path) -> None:
    lookup = [0, 1, 1, 2, 0, 3]
    write_token_map(tmp_path / "m.json", lookup, 4, pad_id=2)
    loaded = load_token_map(tmp_path / "m.json")
    assert (loaded.token_map, loaded.compressed_vocab_size, loaded.pad_id, loaded.pad_compressed_id) == (
        tuple(lookup), 4, 2, 1)
    bad = json.loads((tmp_path / "m.json").read_text()) | {"engram_pad_compressed_id": 0}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="engram_pad_compressed_id"):
        load_token_map(tmp_path / "bad.json")


# ----------------------------------------------------------------- (e) tokenizer
def test_tokenizer_is_deterministic_and_round_trips(tokenizer, checkpoint: Path) -> None:
    assert train_tokenizer(1024).to_str() == tokenizer.to_str()
    assert tokenizer.get_vocab_size() == 1024
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    text = "The keeper said: 2 ** 10 = 1024.\n\tcafé, 東京 🙂  done"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text).ids == [0] + ids  # bos is added like DeepSeek's tokenizer does
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert config["bos_token"] == SPECIAL_TOKENS[0] and config["eos_token"] == SPECIAL_TOKENS[1]
    assert config["pad_token"] == SPECIAL_TOKENS[2] and config["model_max_length"] == 4096


def _render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1])


def test_chat_template_renders_deepseek_format(tokenizer, checkpoint: Path) -> None:
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    assert template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    prompt = _render(template, messages, add_generation_prompt=True)
    assert prompt == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello."
                      "<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>")
    assert _render(template, messages[:2], add_generation_prompt=False).endswith("<｜User｜>Hi")
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == 4 and ids.count(3) == 2 and ids.count(1) == 1


# ----------------------------------------------------------------- default model
def test_default_model_is_created_once_even_under_concurrency(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MINI_DEEPINFER_CACHE", str(tmp_path / "cache"))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: default_model_dir(), range(3)))
    expected = tmp_path / "cache" / "models" / DEFAULT_MODEL_NAME
    assert paths == [expected] * 3
    assert [p.name for p in expected.parent.iterdir()] == [DEFAULT_MODEL_NAME]  # losers cleaned up
    stamp = (expected / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == stamp
    V41Config.from_pretrained(expected)


def test_make_checkpoint_command(tmp_path, capsys):
    """`mini-deepinfer make-checkpoint OUT --preset tiny --seed 3` writes a loadable checkpoint."""
    from deploy.cli import main

    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", str(out), "--preset", "tiny", "--seed", "3"]) == 0
    assert "seed 3" in capsys.readouterr().out
    assert V41Config.from_pretrained(out).num_layers == 6
    assert main(["make-checkpoint", str(out)]) == 2  # exists and not empty: a clear error, not a traceback
    assert "already exists" in capsys.readouterr().err
