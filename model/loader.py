"""Loading a DeepSeek-V4.1 checkpoint in the official layout into a ``V41Model``.

Reads ``config.json``, the safetensors weights (one file, or shards listed in
``model.safetensors.index.json``) and the Engram token map, checks every tensor against
``weight_spec.checkpoint_tensors`` (clear errors for a missing tensor, a wrong shape or dtype),
skips the vision tower and the DSpark draft head with a log line, and builds the modules. FP8/FP4
weights stay in their storage formats (``kernels.QuantizedWeight``; the routed experts of a layer
are stacked into one tensor per projection); ``head`` and the ratio-2 compressor weights, which the
reference multiplies in fp32, are promoted to fp32 (not the head: see ``KernelBackend.logits``). ``load_format="dummy"`` takes random weights
made on the device instead of the files (``dummy_weights.py``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .attention import Attention, AttentionWeights
from .compressor import Compressor
from .config import V41Config, WeightFormat
from .engram import Engram, NgramHasher
from .engram_storage import place_engram_tables
from .engram_token_map import build_compressed_token_map, load_token_map
from .indexer import Indexer
from .kernels import ExpertWeights, KernelBackend, QuantizedWeight, make_backend, stack_quantized
from .layers import Linear
from .mhc import HyperConnection
from .moe import MoE, Router, SharedExpert
from .transformer import Block, ModelOptions, V41Model
from .weight_spec import checkpoint_tensors, is_ignored

log = logging.getLogger(__name__)

_TORCH_DTYPE_NAMES = {
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int64: "I64", torch.int32: "I32",
}


class CheckpointError(ValueError):
    """The checkpoint's files do not hold the model its config describes."""


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank holds: per MoE layer, the logical expert of each of its slots
    (an expert may appear on several ranks: redundant copies), stacked in this order; stack entry 0
    is global slot ``first_slot`` (``workers/expert_placement.py``)."""

    first_slot: int
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def of_range(cls, experts: range, num_layers: int) -> "ExpertShard":
        """The same consecutive experts in every layer, slot ids equal to expert ids."""
        return cls(experts.start, (tuple(experts),) * num_layers)


class CheckpointReader:
    """Name -> tensor access over one or several safetensors files."""

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            if not (path / name).is_file():
                raise CheckpointError(f"{path}: shard {name} listed in the index is missing")
            try:
                handle = safe_open(str(path / name), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a damaged file
                raise CheckpointError(f"{path / name}: not a readable safetensors file ({exc})") from exc
            self._handles[name] = handle
            for key in handle.keys():
                self._file_of[key] = name

    def names(self) -> list[str]:
        return list(self._file_of)

    def dtype_and_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        info = self._handles[self._file_of[name]].get_slice(name)
        return info.get_dtype(), tuple(info.get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)


def validate_checkpoint(cfg: V41Config, reader: CheckpointReader) -> None:
    """Every expected tensor present with the right dtype and shape; log what is skipped."""
    expected = checkpoint_tensors(cfg)
    present = set(reader.names())
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{reader.path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    for name, spec in expected.items():
        dtype, shape = reader.dtype_and_shape(name)
        if dtype != spec.dtype:
            raise CheckpointError(f"{reader.path}: tensor {name} has dtype {dtype}, expected {spec.dtype}")
        if shape != spec.shape:
            raise CheckpointError(f"{reader.path}: tensor {name} has shape {list(shape)}, expected {list(spec.shape)}")
    extra = present - set(expected)
    ignored = [n for n in extra if is_ignored(n)]
    if ignored:
        log.info("ignoring %d vision/DSpark tensors (mtp.*, vision.*, ...): the text backbone does not use them",
                 len(ignored))
    unknown = sorted(extra - set(ignored))
    if unknown:
        log.warning("ignoring %d unknown tensors, e.g. %s", len(unknown), unknown[:3])


def load_engram_token_map(path: Path, cfg: V41Config) -> tuple[list[int], int, int]:
    """(token map, compressed vocab size, pad's compressed id) from engram_token_map.json or tokenizer.json."""
    map_file, tokenizer_file = path / "engram_token_map.json", path / "tokenizer.json"
    if map_file.is_file():
        try:
            token_map = load_token_map(map_file)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        lookup, size, pad = list(token_map.token_map), token_map.compressed_vocab_size, token_map.pad_compressed_id
        if token_map.pad_id != cfg.engram_pad_token_id:
            raise CheckpointError(f"{map_file}: pad id {token_map.pad_id} != config {cfg.engram_pad_token_id}")
    elif tokenizer_file.is_file():
        from tokenizers import Tokenizer

        lookup, size = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_file)))
        pad = lookup[cfg.engram_pad_token_id]
    else:
        raise CheckpointError(f"{path}: Engram needs engram_token_map.json or tokenizer.json")
    if size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{path}: the Engram token map has {size} compressed ids but config.json says "
                              f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")
    if len(lookup) < cfg.vocab_size:
        raise CheckpointError(f"{path}: the Engram token map covers {len(lookup)} of {cfg.vocab_size} token ids")
    return lookup, size, pad


class _Builder:
    """Turns checkpoint tensors into the model's modules, one converter per storage format."""

    def __init__(self, cfg: V41Config, reader: CheckpointReader, options: ModelOptions, shard: ExpertShard,
                 kernels: KernelBackend):
        self.cfg, self.reader, self.options = cfg, reader, options
        self.shard = shard  # the routed experts this rank holds
        self.bi = options.batch_invariant
        self.kernels = kernels
        self.engram_storage = "gpu"  # or "host" (engram_storage.py), decided before the first block

    def t(self, name: str) -> torch.Tensor:
        # A fresh allocation: tensors read straight from the file can sit at any byte offset, and
        # CPU GEMM kernels round differently for differently aligned operands.
        return self.reader.get(name).clone()

    def weight(self, name: str) -> QuantizedWeight | torch.Tensor:
        """A projection's weight as stored: FP8/FP4 with its scales, or a plain bf16 tensor."""
        weight = self.t(f"{name}.weight")
        if weight.dtype == torch.float8_e4m3fn:
            return QuantizedWeight(weight, self.t(f"{name}.scale"), WeightFormat.FP8)
        if weight.dtype == torch.int8:
            return QuantizedWeight(weight, self.t(f"{name}.scale"), WeightFormat.FP4)
        return weight

    def linear(self, name: str) -> Linear:
        return Linear(self.weight(name), self.kernels, self.bi)

    def plain(self, name: str, dtype: torch.dtype | None = None) -> Linear:
        weight = self.t(f"{name}.weight")
        return Linear(weight if dtype is None else weight.to(dtype), self.kernels, self.bi)

    def experts(self, layer: int, prefix: str, device) -> ExpertWeights:
        """This rank's routed experts of ``layer``, each projection stacked over its slots and moved
        to ``device`` (a redundant copy is read again: a fresh tensor per slot)."""
        stacks = []
        for proj in ("w1", "w3", "w2"):
            parts = [self.weight(f"{prefix}.{e}.{proj}") for e in self.shard.layers[layer]]
            stacked = stack_quantized(parts) if isinstance(parts[0], QuantizedWeight) else torch.stack(parts)
            del parts
            stacks.append(stacked.to(device))
        w1, w3, w2 = stacks
        return self.kernels.prepare_experts(ExpertWeights(w1, w3, w2, self.shard.first_slot, self.cfg.swiglu_limit))

    def shared_expert(self, prefix: str) -> SharedExpert:
        return SharedExpert(self.linear(f"{prefix}.w1"), self.linear(f"{prefix}.w2"), self.linear(f"{prefix}.w3"),
                            self.cfg.swiglu_limit)

    def block(self, layer: int, device) -> Block:
        cfg, p = self.cfg, f"layers.{layer}."
        role = cfg.role(layer)
        a = p + "attn."
        compressor = indexer = None
        if role.owns_kv:
            ratio = role.compress_ratio
            # ratio 1 is a plain bf16 projection; ratio > 1 pools fp32 products (``fp32_linear``)
            compressor = Compressor(
                layer, ratio, self.plain(a + "compressor.wkv"),
                self.plain(a + "compressor.wgate") if ratio > 1 else None,
                self.t(a + "compressor.norm.weight"), self.plain(a + "indexer.wk"),
                self.t(a + "indexer.k_norm.weight"), cfg.rms_norm_eps, cfg.rope_head_dim, self.kernels)
        if role.runs_indexer:
            indexer = Indexer(layer, role.compress_ratio, self.linear(a + "indexer.wq_b"),
                              self.plain(a + "indexer.weights_proj"), cfg.index_num_heads, cfg.index_head_dim,
                              cfg.rope_head_dim, cfg.index_topk, role.is_candidate_source, role.uses_candidates,
                              cfg.candidate_topk_blocks, cfg.candidate_block_size, self.bi, self.kernels)
        weights = AttentionWeights(
            wq_a=self.linear(a + "wq_a"), q_norm=self.t(a + "q_norm.weight"), wq_b=self.linear(a + "wq_b"),
            wkv=self.linear(a + "wkv"), kv_norm=self.t(a + "kv_norm.weight"), wo_a=self.weight(a + "wo_a"),
            wo_b=self.linear(a + "wo_b"), sink=self.t(a + "attn_sink").float())
        attention = Attention(cfg, role, weights, compressor, indexer, self.kernels, self.options.reference_layout,
                              max_positions=self.options.max_positions)
        f = p + "ffn."
        router = Router(self.t(f + "gate.weight"), self.t(f + "gate.bias").float(),
                        cfg.num_experts_per_token, cfg.scoring_func, cfg.norm_topk_prob,
                        cfg.routed_scaling_factor, cfg.gate_temperature, self.kernels)
        moe = MoE(router, self.experts(layer, f + "experts", device), self.shared_expert(f + "shared_experts"),
                  cfg.num_routed_experts, self.kernels)
        engram = None
        if role.has_engram:
            e = p + "engram."
            table = self.t(e + "embed.weight")
            table_scale = self.t(e + "embed.scale") if table.dtype == torch.float8_e4m3fn else None
            engram = Engram(table, table_scale, self.linear(e + "wkv"), self.t(e + "q_weight"), self.t(e + "k_weight"),
                            cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps, self.kernels, storage=self.engram_storage)

        def hc(sub: str) -> HyperConnection:
            return HyperConnection(self.t(f"{p}hc_{sub}_fn").float(), self.t(f"{p}hc_{sub}_base").float(),
                                   self.t(f"{p}hc_{sub}_scale").float(), cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                   cfg.hc_eps, cfg.rms_norm_eps, self.kernels)

        return Block(layer, cfg, attention, moe, self.t(p + "attn_norm.weight"), self.t(p + "ffn_norm.weight"),
                     hc("attn"), hc("ffn"), engram, self.kernels).to(device)


def load_model(path: str | Path, options: ModelOptions | None = None, device: str | torch.device = "cpu",
               expert_range: range | ExpertShard | None = None, load_format: str = "auto",
               engram_storage: str | None = None, hf_overrides: Mapping[str, Any] | None = None) -> V41Model:
    """Load a checkpoint directory. ``expert_range``: the routed experts this rank holds (all by
    default): the same range in every layer, or an ``ExpertShard`` (per layer, with copies).

    ``load_format="dummy"``: random weights in their storage formats, made on ``device``; the
    directory needs only ``config.json`` and a tokenizer (Engram tables may be shrunk: logged).
    ``engram_storage``: ``gpu``, ``host`` or None (decided from the free memory; ``engram_storage.py``).
    ``hf_overrides``: values that replace config.json's (``V41Config.from_pretrained``)."""
    path = Path(path)
    options = options or ModelOptions()
    cfg = V41Config.from_pretrained(path, hf_overrides)
    if hf_overrides:
        log.info("config.json with the overrides %s: %d layers, %d routed experts", json.dumps(dict(hf_overrides)),
                 cfg.num_layers, cfg.num_routed_experts)
    if load_format == "dummy":
        from .dummy_weights import DummyCheckpointReader
        from .presets import shrink_engram_config

        cfg = shrink_engram_config(cfg)  # the hasher and the tables must agree on the (smaller) sizes
        reader = DummyCheckpointReader(cfg, device, path=str(path))
    elif load_format == "auto":
        reader = CheckpointReader(path)
    else:
        raise ValueError(f"unknown load format {load_format!r}; available: auto, dummy")
    validate_checkpoint(cfg, reader)
    kernels = make_backend(options.kernels, options.batch_invariant, options.pdl)
    shard = expert_range if isinstance(expert_range, ExpertShard) else \
        ExpertShard.of_range(expert_range or range(cfg.num_routed_experts), cfg.num_layers)
    if len(shard.layers) != cfg.num_layers:
        raise ValueError(f"the expert shard covers {len(shard.layers)} layers, the model has {cfg.num_layers}")
    builder = _Builder(cfg, reader, options, shard, kernels)
    builder.engram_storage = place_engram_tables(cfg, engram_storage, device, checkpoint_bytes(cfg, shard)).storage
    hasher = None
    if cfg.engram_layer_ids:
        lookup, size, pad = load_engram_token_map(path, cfg)
        hasher = NgramHasher.build(cfg, lookup, size, pad, kernels).to(device)
    blocks = [builder.block(layer, device) for layer in _progress(range(cfg.num_layers), "loading weights", "layer")]
    model = V41Model(cfg, options, builder.t("embed.weight").to(device), blocks,
                     builder.t("norm.weight").to(device), builder.t("head.weight").to(device), hasher, kernels)
    held, stored = held_weight_bytes(model), checkpoint_bytes(cfg, shard)
    log.info("weights: %.2f GiB held on %s for %.2f GiB of checkpoint tensors (%+.1f%%: fp32 copies of the small "
             "bf16 weights the reference multiplies in fp32, rope tables of %d positions); kernels: %s", held / 2**30,
             device, stored / 2**30, 100.0 * (held - stored) / stored, blocks[0].attention.rope.table.shape[0],
             kernels.name)
    return model


def _progress(items, description: str, unit: str):
    """A tqdm bar on stderr: only on a terminal, only while INFO is logged, and only on the first rank
    (several workers' bars on one terminal would overwrite each other)."""
    import sys

    import torch.distributed as dist

    if (not sys.stderr.isatty() or not log.isEnabledFor(logging.INFO)
            or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)):
        return items  # (not even a disabled bar: tqdm would make a process-shared lock for nothing)
    import threading

    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):  # a thread lock: tqdm's default, a multiprocessing one, leaks at worker exit
        tqdm.set_lock(threading.RLock())
    return tqdm(items, desc=description, unit=unit, leave=False)


_DTYPE_BYTES = {"BF16": 2, "F32": 4, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}


def checkpoint_bytes(cfg: V41Config, experts: range | ExpertShard) -> int:
    """Bytes of the checkpoint tensors a rank holding ``experts`` loads (a redundant copy counts again)."""
    shard = experts if isinstance(experts, ExpertShard) else ExpertShard.of_range(experts, cfg.num_layers)
    total = 0
    for name, spec in checkpoint_tensors(cfg).items():
        copies = 1
        if ".ffn.experts." in name:
            layer = int(name.split(".")[1])
            copies = shard.layers[layer].count(int(name.split(".ffn.experts.")[1].split(".")[0]))
        total += copies * math.prod(spec.shape) * _DTYPE_BYTES[spec.dtype]
    return total


def held_weight_bytes(model: V41Model) -> int:
    """Bytes of every tensor the model's modules hold (each storage counted once)."""
    from .kernels import QuantizedWeight

    storages: dict[int, int] = {}
    visited: set[int] = set()

    def visit(obj) -> None:
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, QuantizedWeight):
            visit(obj.values)
            visit(obj.scales)
        elif isinstance(obj, Engram) and obj.host_mapped:  # its tables take no device memory
            for name, value in vars(obj).items():
                if name not in ("table", "table_scale"):
                    visit(value)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (V41Config, type)):
            for value in vars(obj).values():
                visit(value)

    visit(model.blocks)
    for tensor in (model.embed, model.final_norm, model.head):
        visit(tensor)
    return sum(storages.values())
