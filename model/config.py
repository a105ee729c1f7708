"""DeepSeek-V4.1 model configuration, read once from a Hugging Face style ``config.json``.

The checkpoint's ``config.json`` has ``model_type: deepseek_v41`` and the text model's keys under
``text_config``. Everything the network needs is resolved here into one frozen dataclass,
including the per-layer roles of the compressed sparse attention (which layer owns the
compressed KV a layer reads, which layer's top-k it reuses), so no other module re-derives them.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """The checkpoint's config.json cannot describe a DeepSeek-V4.1 model we can run."""


class WeightFormat(str, Enum):
    BF16 = "bf16"
    FP8 = "fp8"  # e4m3 values with one UE8M0 power-of-two scale per 32x32 tile
    FP4 = "fp4"  # packed e2m1 pairs with one UE8M0 scale per 32 along K (MXFP4)


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer's attention does, derived from the config's layer lists.

    A layer with ``compress_ratio > 0`` reads compressed KV from ``kv_source`` (the most recent
    kv-source layer at or before it) and attends to the compressed entries picked by the indexer of
    ``topk_source`` (the most recent index-source layer at or before it).
    """

    layer_id: int
    compress_ratio: int
    kv_source: int | None
    topk_source: int | None
    owns_kv: bool  # runs the compressor and writes compressed KV + index keys
    runs_indexer: bool  # computes its own top-k (possibly on another layer's keys)
    is_candidate_source: bool  # publishes the first-level candidate-block mask
    uses_candidates: bool  # restricts its top-k to the candidate source's blocks
    has_engram: bool

    @property
    def block_type(self) -> str:
        """The reference's name for this layer's role (useful in logs and error messages)."""
        if self.compress_ratio == 0:
            return "SWA_ONLY"
        if self.is_candidate_source:
            return "CANDIDATE_SOURCE"
        if self.owns_kv:
            return "KV_INDEX_SOURCE"
        if self.runs_indexer:
            return "CANDIDATE_INDEX_SOURCE" if self.uses_candidates else "INDEX_SOURCE"
        return f"CONSUMER_RATIO{self.compress_ratio}"


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    rms_norm_eps: float
    max_position_embeddings: int
    # rope: ratio-0 layers use rope_theta without YaRN; compressed layers use compress_rope_theta + YaRN
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    # MoE
    num_routed_experts: int
    num_shared_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    gate_temperature: float
    # attention
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int  # -1: no two-level selection
    candidate_topk_blocks: int
    candidate_block_size: int
    # manifold-constrained hyper-connections
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_num_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    # weights
    dense_format: WeightFormat
    expert_format: WeightFormat
    weight_block_size: int = 32
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    roles: tuple[LayerRole, ...] = field(default=(), compare=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def num_hash_columns(self) -> int:
        """Engram hash ids per position and layer: (max_ngram_size - 1) n-gram sizes x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_num_heads

    @property
    def kv_source_layers(self) -> tuple[int, ...]:
        return tuple(r.layer_id for r in self.roles if r.owns_kv)

    def role(self, layer_id: int) -> LayerRole:
        return self.roles[layer_id]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> "V41Config":
        """``overrides``: values that replace config.json's (``with_overrides``), e.g. fewer layers or
        experts for a dummy load of a real-size model (vLLM's ``--hf-overrides``)."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ConfigError(f"no config.json at {config_file}")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_file} is not valid JSON: {exc}") from exc
        source = str(config_file)
        if overrides:
            raw = with_overrides(raw, overrides, source)
            source += f" with the overrides {json.dumps(dict(overrides))}"
        return cls.from_hf_dict(raw, source=source)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config") -> "V41Config":
        model_type = raw.get("model_type")
        if model_type != "deepseek_v41":
            raise ConfigError(
                f"{source}: model_type is {model_type!r}; mini-deepinfer serves DeepSeek-V4.1 "
                "checkpoints (model_type 'deepseek_v41')"
            )
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: missing 'text_config' object")
        quant = raw.get("quantization_config") or text.get("quantization_config")

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"{source}: text_config.{key} is missing")
            return text[key]

        rope_scaling = text.get("rope_scaling") or {}
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"{source}: quantization_config must be an object, got {quant!r}")
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ConfigError(f"{source}: unsupported quant_method {quant.get('quant_method')!r}")
            block = quant.get("weight_block_size", [32, 32])
            if list(block) != [32, 32]:
                raise ConfigError(f"{source}: weight_block_size {block} unsupported (V4.1 uses [32, 32])")
            dense_format = WeightFormat.FP8
            expert_format = WeightFormat.FP4 if quant.get("expert_dtype") == "fp4" else WeightFormat.FP8
        else:
            dense_format = expert_format = WeightFormat.BF16

        candidate = text.get("candidate_source_layer_id")
        try:
            cfg = cls(
                vocab_size=int(need("vocab_size")),
                hidden_size=int(need("hidden_size")),
                num_layers=int(need("num_hidden_layers")),
                num_heads=int(need("num_attention_heads")),
                head_dim=int(need("head_dim")),
                rope_head_dim=int(need("qk_rope_head_dim")),
                q_lora_rank=int(need("q_lora_rank")),
                o_lora_rank=int(need("o_lora_rank")),
                o_groups=int(need("o_groups")),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-20)),
                max_position_embeddings=int(need("max_position_embeddings")),
                rope_theta=float(text.get("rope_theta", 10000.0)),
                compress_rope_theta=float(text.get("compress_rope_theta", 160000.0)),
                rope_factor=float(rope_scaling.get("factor", 1.0)),
                beta_fast=float(rope_scaling.get("beta_fast", 32)),
                beta_slow=float(rope_scaling.get("beta_slow", 1)),
                original_max_position_embeddings=int(rope_scaling.get("original_max_position_embeddings", 0)),
                num_routed_experts=int(need("n_routed_experts")),
                num_shared_experts=int(text.get("n_shared_experts", 1)),
                num_experts_per_token=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                scoring_func=str(text.get("scoring_func", "sqrtsoftplus")),
                norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
                swiglu_limit=float(text.get("swiglu_limit", 0.0)),
                gate_temperature=float(text.get("gate_temperature", 1.0)),
                sliding_window=int(need("sliding_window")),
                compress_ratios=tuple(int(r) for r in need("compress_ratios")),
                kv_source_layer_ids=tuple(int(i) for i in text.get("kv_source_layer_ids", ())),
                index_source_layer_ids=tuple(int(i) for i in text.get("index_source_layer_ids", ())),
                index_num_heads=int(text.get("index_n_heads", 0)),
                index_head_dim=int(text.get("index_head_dim", 0)),
                index_topk=int(text.get("index_topk", 0)),
                candidate_source_layer_id=-1 if candidate is None else int(candidate),
                candidate_topk_blocks=int(text.get("candidate_topk_blocks", 0)),
                candidate_block_size=int(text.get("candidate_block_size", 0)),
                hc_mult=int(text.get("hc_mult", 4)),
                hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(text.get("hc_eps", 1e-6)),
                engram_layer_ids=tuple(int(i) for i in text.get("engram_layer_ids", ())),
                engram_num_embeddings=tuple(int(i) for i in text.get("engram_num_embeddings", ())),
                engram_max_ngram_size=int(text.get("engram_max_ngram_size", 1)),
                engram_vocab_size=int(text.get("engram_vocab_size", 0)),
                engram_num_heads=int(text.get("engram_n_heads", 0)),
                engram_head_dim=int(text.get("engram_head_dim", 0)),
                engram_pad_token_id=int(text.get("engram_pad_token_id", 2)),
                engram_compressed_vocab_size=int(text.get("engram_compressed_vocab_size", 0)),
                dense_format=dense_format,
                expert_format=expert_format,
                bos_token_id=raw.get("bos_token_id", text.get("bos_token_id")),
                eos_token_id=_first_id(raw.get("eos_token_id", text.get("eos_token_id"))),
            )
        except ConfigError:
            raise
        except (AttributeError, TypeError, ValueError) as exc:  # "num_hidden_layers": "four", "rope_scaling": 2
            raise ConfigError(f"{source}: a value of text_config has the wrong type ({exc})") from None
        if len(cfg.compress_ratios) < cfg.num_layers:  # before the roles, which read one ratio per layer
            raise ConfigError(f"{source}: compress_ratios has {len(cfg.compress_ratios)} entries for "
                              f"{cfg.num_layers} layers")
        cfg = cfg.with_roles()
        cfg.validate(source)
        return cfg

    def with_roles(self) -> "V41Config":
        """Derive each layer's attention role: a layer reads the most recent source at or before it."""
        roles = []
        for layer in range(self.num_layers):
            ratio = self.compress_ratios[layer]
            kv_src = _latest_at_or_before(self.kv_source_layer_ids, layer) if ratio else None
            topk_src = _latest_at_or_before(self.index_source_layer_ids, layer) if ratio else None
            cand = self.candidate_source_layer_id
            roles.append(
                LayerRole(
                    layer_id=layer,
                    compress_ratio=ratio,
                    kv_source=kv_src,
                    topk_source=topk_src,
                    owns_kv=ratio > 0 and layer in self.kv_source_layer_ids,
                    runs_indexer=ratio > 0 and layer in self.index_source_layer_ids,
                    is_candidate_source=ratio > 0 and layer == cand,
                    uses_candidates=ratio > 0 and 0 <= cand < layer and layer in self.index_source_layer_ids,
                    has_engram=layer in self.engram_layer_ids,
                )
            )
        object.__setattr__(self, "roles", tuple(roles))
        return self

    def validate(self, source: str = "config") -> None:
        """Reject configurations the reference numerics cannot express, with the reason."""

        def fail(msg: str) -> None:
            raise ConfigError(f"{source}: {msg}")

        if self.num_layers < 1:
            fail(f"num_hidden_layers={self.num_layers} must be >= 1")
        if not 1 <= self.num_experts_per_token <= self.num_routed_experts:
            fail(f"num_experts_per_tok={self.num_experts_per_token} must be between 1 and "
                 f"n_routed_experts={self.num_routed_experts}")
        quantized = self.dense_format is not WeightFormat.BF16
        for name, k in [("hidden_size", self.hidden_size), ("q_lora_rank", self.q_lora_rank),
                        ("head_dim", self.head_dim), ("moe_intermediate_size", self.moe_intermediate_size),
                        ("n_heads*head_dim/o_groups", self.num_heads * self.head_dim // max(self.o_groups, 1)),
                        ("o_groups*o_lora_rank", self.o_groups * self.o_lora_rank)]:
            if quantized and k % 32:
                fail(f"{name}={k} must be a multiple of 32 (FP8 activation groups)")
        if self.head_dim % 16:
            fail(f"head_dim={self.head_dim} must be a multiple of 16 (FP4 compressed-KV groups)")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            fail(f"qk_rope_head_dim={self.rope_head_dim} must be even and <= head_dim")
        if self.num_heads % self.o_groups:
            fail(f"num_attention_heads={self.num_heads} not divisible by o_groups={self.o_groups}")
        for layer, role in enumerate(self.roles):
            r = role.compress_ratio
            if r not in (0, 1, 2):
                fail(f"layer {layer}: compress ratio {r} (V4.1 uses 0, 1 or 2)")
            if r == 0:
                continue
            if role.kv_source is None:
                fail(f"layer {layer} has compress ratio {r} but no kv source layer at or before it")
            if self.compress_ratios[role.kv_source] != r:
                fail(f"layer {layer} (ratio {r}) reads kv source {role.kv_source} of another ratio")
            if role.topk_source is None:
                fail(f"layer {layer} has compress ratio {r} but no index source layer at or before it")
            if self.compress_ratios[role.topk_source] != r:
                fail(f"layer {layer} (ratio {r}) reuses the top-k of layer {role.topk_source} of another ratio")
            if role.runs_indexer and (self.index_head_dim % 32 or self.index_head_dim < self.rope_head_dim):
                fail(f"index_head_dim={self.index_head_dim} must be a multiple of 32 and >= rope dims")
        cand = self.candidate_source_layer_id
        if cand >= 0:
            if cand >= self.num_layers:
                fail(f"candidate_source_layer_id={cand} is past the last of the {self.num_layers} layers (with fewer "
                     "layers, name one of the index source layers left, or -1 for none)")
            if not self.roles[cand].runs_indexer:
                fail(f"candidate_source_layer_id={cand} is not an index source layer")
            if not self.roles[cand].owns_kv:
                fail(f"candidate_source_layer_id={cand} must own its index keys")
            bs = self.candidate_block_size
            if bs <= 0 or self.candidate_topk_blocks * bs - (bs - 1) < self.index_topk:
                fail("candidate_topk_blocks*candidate_block_size-(block-1) must be >= index_topk")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                fail("engram_num_embeddings needs one entry per engram layer")
            if self.engram_head_dim % 32:
                fail(f"engram_head_dim={self.engram_head_dim} must be a multiple of 32")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            fail(f"scoring_func {self.scoring_func!r} unknown")
        if self.num_shared_experts != 1:
            fail("V4.1 has exactly one shared expert")


def with_overrides(raw: dict[str, Any], overrides: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """A copy of a config.json dict with ``overrides`` applied: a key of ``text_config`` (where the
    model's keys live) or of the top level (``quantization_config``) takes the given value; a
    dict merges into the dict it replaces, key by key. A key the file does not have is an error,
    with the closest names: a misspelt override would otherwise leave the model as it was."""
    merged = copy.deepcopy(raw)
    text = merged.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: missing 'text_config' object")
    for key, value in overrides.items():
        target = text if key in text else merged if key in merged else None
        if target is None:
            close = difflib.get_close_matches(key, [*text, *merged], n=3)
            hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
            raise ConfigError(f"{source}: cannot override {key!r}: config.json has no such key{hint}")
        target[key] = _merged(target[key], value)
    return merged


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, Mapping):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return copy.deepcopy(new)


def _latest_at_or_before(ids: tuple[int, ...], layer: int) -> int | None:
    eligible = [i for i in ids if i <= layer]
    return max(eligible) if eligible else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)
