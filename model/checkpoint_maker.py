"""Write a seeded random DeepSeek-V4.1 checkpoint in the official layout (``make-checkpoint``).

The engine must be runnable without downloading anything, so it can make its own model: a
preset config, a trained byte-level BPE tokenizer, the Engram token map derived from it, and
exactly the tensors ``model.weight_spec.checkpoint_tensors`` lists, with random values whose
statistics follow the golden tiny model (``shared/golden/v41/README.md``, section 4). Realistic
statistics matter: a model with wrong norm or gain scales saturates the FP8 quantizers, gives
degenerate routing and flat logits, and would hide bugs that the real model exposes.

Everything is drawn from one ``torch.Generator`` in ``checkpoint_tensors`` order, so the same
preset and seed give byte-identical files. ``model.dummy_weights`` uses the same initialisers to
make weights up on a device for ``--load-format dummy`` (``make-checkpoint --config-only`` writes
the directory such a load starts from). A checkpoint is built in a temporary sibling
directory and renamed into place, so a reader never sees half a model; ``default_model_dir``
relies on that to let several processes race to create the cached default model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import V41Config
from .engram_token_map import build_compressed_token_map, write_token_map
from .presets import preset_config, preset_vocab_size
from .tokenizer_builder import PAD_TOKEN, save_tokenizer, train_tokenizer
from .quant import pack_e2m1
from .weight_spec import TensorSpec, checkpoint_tensors

logger = logging.getLogger(__name__)

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
# the suffix changes whenever make_checkpoint would write different files, so a stale cached copy
# is never mistaken for the current default model
DEFAULT_MODEL_NAME = "tiny-v41-seed0-r1"
CACHE_ENV = "MINI_DEEPINFER_CACHE"
WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "engram_token_map.json",
    WEIGHTS_FILE,
)

# ----------------------------------------------------------------- statistics (golden README, section 4)
# Gains are keyed by the module's own name, as the reference initialiser does, so the compressor's
# and Engram's ``wkv`` share attention's 1.8 and ``indexer.wq_b`` shares ``wq_b``'s 0.95 (this is
# what the golden checkpoint's weights measure); every other projection has gain 1.
GAINS = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9,
         "w1": 1.5, "w3": 1.5, "w2": 1.05}
NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4,
              "compressor_norm": 0.6, "k_norm": 0.5, "final_norm": 1.0}
NORM_SPREAD = 0.1  # relative standard deviation of norm weights around their mean
EMBED_RMS = 0.12
VECTOR_STD = 0.5  # attention sinks, gate biases, hyper-connection bases and scales
ENGRAM_QK_STD = 0.1  # Engram's gate q/k weights scale normalised vectors: ~1 each
FP4_SCALE_DIVISOR = 3.2  # FP4 block scale ~ target std / 3.2 (uniform E2M1 codes have rms ~2.9)
PROJECTION_KINDS = frozenset({"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer_wq_b", "w1", "w2", "w3",
                              "engram_wkv", "compressor", "indexer_wk", "weights_proj", "gate", "head"})

# ----------------------------------------------------------------- number formats
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 32
TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
_QUANT_BAND_ELEMENTS = 1 << 26  # fp32 scratch per band of quantize_fp8: 256 MB


def power_of_two_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), computed exactly from the binary exponent."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(x), exponent)


def quantize_fp8(weight: torch.Tensor, block_rows: int = BLOCK, block_cols: int = BLOCK,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8: e4m3 values and one UE8M0 scale per ``block_rows x block_cols`` tile.

    The scale is the smallest power of two that brings the tile's largest magnitude within
    e4m3's range, so the division is exact and the only rounding is e4m3's round-to-nearest-even.
    Works on the tensor's device, a band of whole tile rows at a time so that a large tensor (a
    real-size Engram table) needs little scratch memory beyond its result.
    """
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=weight.device)
    band = max(1, _QUANT_BAND_ELEMENTS // (block_rows * cols)) * block_rows
    scales = []
    for start in range(0, rows, band):
        band_values, band_scale = _quantize_fp8_band(weight[start:start + band], block_rows, block_cols)
        values[start:start + band] = band_values
        scales.append(band_scale)
    return values, torch.cat(scales).to(torch.float8_e8m0fnu)


def _quantize_fp8_band(weight: torch.Tensor, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8`` of a few tile rows; the scales come back as fp32 powers of two."""
    rows, cols = weight.shape
    grid_r, grid_c = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = torch.zeros(grid_r * block_rows, grid_c * block_cols, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid_r, block_rows, grid_c, block_cols)
    amax = tiles.abs().amax(dim=(1, 3)).double()
    # An all-zero tile gets the smallest normal scale instead of dividing by zero.
    scale = power_of_two_ceil((amax / FP8_MAX).clamp(min=2.0 ** -126)).float()
    scaled = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn), scale


# ----------------------------------------------------------------- random weights
# Every initialiser draws from the generator it is given, on that generator's device, so the same
# code fills a checkpoint file on the CPU and dummy weights directly on a GPU.
def _gain(name: str) -> float:
    module = name.split(".")[-2] if "." in name else name
    return GAINS.get(module, 1.0)


def _float_values(name: str, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """fp32 values of a tensor stored unquantized (BF16/F32), by what the tensor is."""
    normal = torch.randn(spec.shape, generator=gen, dtype=torch.float32, device=gen.device)
    kind, fan_in = spec.kind, spec.shape[-1]
    if kind == "embed":
        return normal * EMBED_RMS
    if kind in NORM_MEANS:
        return NORM_MEANS[kind] * (1.0 + NORM_SPREAD * normal)
    if kind == "engram_qk":
        return 1.0 + ENGRAM_QK_STD * normal
    if kind == "engram_table":
        return normal
    if kind in ("vector", "gate_bias"):
        return VECTOR_STD * normal
    if kind == "hc_fn":
        return normal * fan_in ** -0.5
    if kind in PROJECTION_KINDS:
        return normal * (_gain(name) * fan_in ** -0.5)
    raise ValueError(f"{name}: no initialiser for tensor kind {kind!r}")


def _random_fp8(name: str, spec: TensorSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    normal = torch.randn(spec.shape, generator=gen, dtype=torch.float32, device=gen.device)
    if spec.kind == "engram_table":
        # Table rows are unit gaussian, scaled per row and per 32 columns.
        return quantize_fp8(normal, 1, BLOCK)
    if spec.kind not in PROJECTION_KINDS:
        raise ValueError(f"{name}: no FP8 initialiser for tensor kind {spec.kind!r}")
    return quantize_fp8(normal.mul_(_gain(name) * spec.shape[1] ** -0.5))


def _random_fp4(name: str, spec: TensorSpec, gen: torch.Generator, packed_codes: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random E2M1 codes with per-row-per-32 power-of-two scales around the target std.

    ``packed_codes`` draws the packed bytes directly (the same uniform codes, one random byte per
    pair instead of one int64 per code): the fast path for real-size dummy experts. Checkpoint
    files keep drawing one code at a time, so their bytes never change.
    """
    out_f, in_f = spec.shape[0], spec.shape[1] * 2
    if packed_codes:
        packed = torch.randint(-128, 128, spec.shape, generator=gen, dtype=torch.int8, device=gen.device)
    else:
        codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.int64, device=gen.device)
        packed = pack_e2m1(codes.to(torch.uint8)).view(torch.int8)
    target = _gain(name) * in_f ** -0.5 / FP4_SCALE_DIVISOR
    jitter = torch.randint(-1, 2, (out_f, in_f // BLOCK), generator=gen, dtype=torch.int64, device=gen.device)
    exponents = (round(math.log2(target)) + jitter).float()
    return packed, torch.exp2(exponents).to(torch.float8_e8m0fnu)


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def random_tensor(name: str, spec: TensorSpec, gen: torch.Generator, packed_fp4_codes: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight in its storage format and, for FP8/FP4, its scale tensor (else None)."""
    if spec.dtype == "F8_E4M3":
        return _random_fp8(name, spec, gen)
    if spec.dtype == "I8":
        return _random_fp4(name, spec, gen, packed_fp4_codes)
    return _float_values(name, spec, gen).to(TORCH_DTYPES[spec.dtype]), None


def check_tensor(name: str, tensor: torch.Tensor, spec: TensorSpec | None) -> None:
    """A made tensor must be exactly what the spec lists (a mismatch is a bug of the initialisers)."""
    if spec is None:
        raise AssertionError(f"made {name}, which the weight spec does not list")
    if tuple(tensor.shape) != spec.shape or tensor.dtype != TORCH_DTYPES[spec.dtype]:
        raise AssertionError(f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, spec says {spec}")


def random_weights(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint_tensors(cfg)``, drawn from one generator in spec order."""
    specs = checkpoint_tensors(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.kind == "scale":
            continue  # made together with its weight
        tensors[name], scale = random_tensor(name, spec, gen)
        if scale is not None:
            check_tensor(scale_name(name), scale, specs.get(scale_name(name)))
            tensors[scale_name(name)] = scale
    for name, spec in specs.items():
        check_tensor(name, tensors[name], spec)
    return tensors


# ----------------------------------------------------------------- checkpoint directory
def _write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def write_checkpoint_files(out_dir: Path, preset: str, seed: int, config_only: bool = False) -> None:
    """Write every checkpoint file into the existing directory ``out_dir`` (not atomic by itself).

    ``config_only`` leaves out ``model.safetensors``: such a directory describes the model for
    ``--load-format dummy``, which makes the weights up on the device instead.
    """
    tokenizer = train_tokenizer(preset_vocab_size(preset))
    config = preset_config(preset, tokenizer)
    cfg = V41Config.from_hf_dict(config, source=f"preset {preset!r}")
    text = config["text_config"]
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    save_tokenizer(tokenizer, out_dir, model_max_length=text["max_position_embeddings"])
    lookup, compressed = build_compressed_token_map(tokenizer)
    write_token_map(out_dir / "engram_token_map.json", lookup, compressed, tokenizer.token_to_id(PAD_TOKEN))
    if not config_only:
        # One metadata key only: safetensors keeps metadata in a hash map, so several keys would be
        # written in a random order and break byte-identical output.
        save_file(random_weights(cfg, seed), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in CHECKPOINT_FILES:  # some writers create private temp files and rename them
        if not (config_only and name == WEIGHTS_FILE):
            os.chmod(out_dir / name, 0o644)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _publish(staged: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished ``staged`` directory to ``out_dir`` with a rename (atomic on one filesystem)."""
    if out_dir.exists() and not _is_empty_dir(out_dir):
        if not overwrite:
            raise FileExistsError(f"{out_dir} already exists and is not empty")
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, trash / out_dir.name)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(staged, out_dir)  # replaces an empty directory; fails on a non-empty one
    except OSError as exc:
        if out_dir.is_dir() and not _is_empty_dir(out_dir):
            raise FileExistsError(f"{out_dir} was created by someone else meanwhile") from exc
        raise


def make_checkpoint(out_dir: str | Path, preset: str = DEFAULT_PRESET, seed: int = DEFAULT_SEED,
                    overwrite: bool = False, config_only: bool = False) -> Path:
    """Write a random ``preset`` checkpoint seeded with ``seed`` to ``out_dir``; returns its path.

    ``out_dir`` must not exist or be empty, unless ``overwrite``. Raises ``FileExistsError`` when
    it is (or becomes, through a concurrent writer) a non-empty directory. ``config_only`` writes
    everything but the weights (seconds, even for the real-size presets).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    preset_vocab_size(preset)  # unknown preset: fail before touching the filesystem
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if not overwrite and out_dir.exists() and not _is_empty_dir(out_dir):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(staged, 0o755)  # mkdtemp makes it private; the published model is not
        write_checkpoint_files(staged, preset, int(seed), config_only)
        _publish(staged, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out_dir


def is_complete_checkpoint(path: Path) -> bool:
    return all((path / name).is_file() for name in CHECKPOINT_FILES)


def cache_dir() -> Path:
    """Root of mini-deepinfer's cache: ``$MINI_DEEPINFER_CACHE`` or ``~/.cache/mini-deepinfer``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "mini-deepinfer"


def default_model_dir() -> Path:
    """The default model (preset tiny, seed 0), created on first use and cached.

    Safe under concurrency: each process that finds no model builds one privately and renames it
    into place; the first rename wins and the others use the winner's (identical) model.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if is_complete_checkpoint(target):
        return target
    logger.info("creating the default model (preset %s, seed %d) at %s", DEFAULT_PRESET, DEFAULT_SEED, target)
    started = time.perf_counter()
    try:
        make_checkpoint(target, DEFAULT_PRESET, DEFAULT_SEED)
    except FileExistsError:
        if not is_complete_checkpoint(target):
            raise FileExistsError(
                f"{target} exists but is not a complete checkpoint; remove it to let it be recreated"
            ) from None
        return target  # a concurrent process created it first
    logger.info("default model created in %.2f s", time.perf_counter() - started)
    return target
