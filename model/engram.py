"""Engram: n-gram hash lookups gated into the residual stream before selected blocks.

Hashing (once per forward, shared by all Engram layers): every token id is mapped to its
compressed id (``engram_token_map.json``); a position's n-grams are its own compressed id and the
``max_ngram_size - 1`` before it (the pad's compressed id before the sequence start). Per layer,
the n-gram of size n hashes as the XOR of ``token_i * multiplier_i`` (int64, i < n), and each of
the ``n_heads`` heads buckets that hash modulo its own prime, offset into the layer's table.
Column order of the hash ids: [2-gram heads, 3-gram heads, ...].

Module: the looked-up FP8 rows are dequantized, projected by ``wkv`` into one key per hc copy plus
a shared value; a gate per copy (a normalised dot product of stream and key, signed-sqrt then
sigmoid) decides how much of the value is added to that copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import ForwardBatch
from .cache import V41Cache
from .config import V41Config
from .engram_storage import STORAGES, host_resident
from .kernels import KernelBackend
from .layers import Linear
from .quant import dequantize_fp8_rows
from .presets import engram_bucket_primes


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """[layers, max_ngram_size] odd int64 multipliers, from a per-layer numpy RNG seeded 10007 * layer.

    Bounded so that ``compressed_id * multiplier`` cannot overflow int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        values = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


@dataclass
class NgramHasher:
    """Hash ids of every position's n-grams, for all Engram layers at once."""

    layer_ids: tuple[int, ...]  # the Engram layers the model has, in the order of the hash ids' columns
    token_map: torch.Tensor  # [vocab] int64
    pad_compressed_id: int
    multipliers: torch.Tensor  # [layers, max_ngram]
    primes: torch.Tensor  # [layers, max_ngram - 1, heads]
    offsets: torch.Tensor  # [layers, (max_ngram - 1) * heads]
    max_ngram_size: int
    kernels: KernelBackend  # hashes through ``ngram_hash_ids`` (the Triton backend: one launch)

    @classmethod
    def build(cls, cfg: V41Config, token_map: list[int] | tuple[int, ...], compressed_vocab_size: int,
              pad_compressed_id: int, kernels: KernelBackend) -> "NgramHasher":
        n, heads = cfg.engram_max_ngram_size, cfg.engram_num_heads
        per_layer = engram_bucket_primes(list(cfg.engram_layer_ids), n, cfg.engram_vocab_size, heads)
        primes = torch.tensor(per_layer, dtype=torch.int64).view(len(per_layer), n - 1, heads)
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat  # each (n, head) range starts after the previous ones
        multipliers = hash_multipliers(cfg.engram_layer_ids, n, compressed_vocab_size)
        # a model cut short (``--hf-overrides`` with fewer layers) keeps the hashes of the Engram layers it
        # has: their primes were picked among all the config's layers, so they are computed first, then kept
        present = [i for i, layer in enumerate(cfg.engram_layer_ids) if layer < cfg.num_layers]
        return cls(tuple(cfg.engram_layer_ids[i] for i in present), torch.tensor(list(token_map), dtype=torch.int64),
                   pad_compressed_id, multipliers[present], primes[present], offsets[present], n, kernels)

    def column(self, layer_id: int) -> int:
        """The hash ids' column (``__call__``'s second dimension) of an Engram layer."""
        return self.layer_ids.index(layer_id)

    def to(self, device) -> "NgramHasher":
        for name in ("token_map", "multipliers", "primes", "offsets"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def __call__(self, batch: ForwardBatch, cache: V41Cache) -> torch.Tensor:
        """[T, layers, (max_ngram - 1) * heads] hash ids; updates the sequences' n-gram history."""
        compressed = self.token_map[batch.token_ids]
        if batch.num_tokens == 0:
            return self.offsets.new_zeros(0, *self.offsets.shape)
        history, keep, layout, pos = cache.engram_history, cache.history_len, batch.layout, batch.positions
        hashes = self.kernels.ngram_hash_ids(compressed, pos, layout.start, layout.offset, layout.slot, history,
                                             self.pad_compressed_id, self.multipliers, self.primes, self.offsets)
        if batch.padded:  # one token per row: every row is its sequence's newest position
            history[layout.slot, pos % keep] = compressed
        else:
            recent = batch.rows_from(lambda chunk: chunk.end - keep)  # each sequence's last positions
            history[layout.slot[recent], pos[recent] % keep] = compressed[recent]
        return hashes


def ngram_hash_ids(compressed: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, offset: torch.Tensor,
                   slot: torch.Tensor, history: torch.Tensor, pad_id: int, multipliers: torch.Tensor,
                   primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The hash ids ``[T, layers, (n - 1) * heads]`` of every token's n-grams (the module docstring):
    ``compressed [T]`` the tokens' compressed ids, ``positions``/``start``/``offset``/``slot`` ``[T]``
    each token's position, its chunk's first position and first row, its sequence's slot;
    ``history [S, keep]`` each slot's ring of compressed ids (read only)."""
    n = multipliers.shape[1]
    lookback = []  # lookback[i][t] = compressed id i positions before token t (pad before the start)
    for shift in range(n):
        source = positions - shift
        in_chunk = source >= start
        from_chunk = compressed[offset + (source - start).clamp(min=0)]
        from_history = history[slot, source.clamp(min=0) % history.shape[1]]
        ids = torch.where(in_chunk, from_chunk, from_history)
        lookback.append(torch.where(source >= 0, ids, pad_id))
    tokens = torch.stack(lookback, dim=-1)  # [T, n]
    products = tokens.unsqueeze(1) * multipliers  # [T, layers, n]
    rolling, hashes = products[..., 0], []
    for i in range(1, n):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + offsets


class Engram:
    def __init__(self, table: torch.Tensor, table_scale: torch.Tensor | None, wkv: Linear, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, hc: int, dim: int, eps: float, kernels: KernelBackend, storage: str = "gpu"):
        # [rows, head_dim] as stored: e4m3 values with one UE8M0 scale per row per 32 (table_scale),
        # or bf16; only the gathered rows are ever dequantized
        self.table, self.table_scale = table, table_scale
        self.wkv, self.hc, self.dim, self.eps, self.kernels = wkv, hc, dim, eps, kernels
        self.gate_weight = q_weight.float() * k_weight.float()  # only ever used as a product
        self.clamp_value = 1e-6
        # "gpu": the tables move with the module; "host": on a GPU they stay in host memory and the
        # GPU gathers their rows in place (engram_storage.py); the lookup code is the same
        if storage not in STORAGES:
            raise ValueError(f"Engram storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        self.storage = storage
        self.host_mapped = False  # the tables are GPU views of host memory

    def to(self, device) -> "Engram":
        device = torch.device(device)
        if self.storage == "host" and device.type == "cuda":
            if not self.host_mapped:  # (mapping an already mapped table would copy it)
                self.table = host_resident(self.table, device)
                if self.table_scale is not None:
                    self.table_scale = host_resident(self.table_scale, device)
                self.host_mapped = True
        else:
            self.table = self.table.to(device)
            if self.table_scale is not None:
                self.table_scale = self.table_scale.to(device)
            self.host_mapped = False
        self.gate_weight = self.gate_weight.to(device)
        self.wkv.to(device)
        return self

    def __call__(self, stream: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """stream [T, hc, D] bf16, hash_ids [T, columns] -> new stream [T, hc, D]."""
        return self.gate(stream, *self.look_up(hash_ids))

    def look_up(self, hash_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``hash_ids [T, columns]`` projected to ``(key [T, hc * D], value [T, D])``. They depend
        on the token ids alone, so the model looks them up beside the layers before this one."""
        rows = self.table[hash_ids]  # [T, columns, head_dim]
        if self.table_scale is not None:
            rows = dequantize_fp8_rows(rows, self.table_scale[hash_ids])
        kv = self.wkv(rows.flatten(-2))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        return key, value

    def gate(self, stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The looked-up ``value`` added to ``stream [T, hc, D]``, gated by each copy's match with ``key``."""
        return self.kernels.engram_gate(stream, key, value, self.gate_weight, self.eps, self.clamp_value)


def engram_gate(stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float,
                clamp_value: float) -> torch.Tensor:
    """Engram's gated add (the reference's arithmetic): ``stream [T, hc, D]``, the looked-up ``key [T,
    hc * D]`` and ``value [T, D]``, ``weight [hc, D]`` (q_weight * k_weight) -> the new stream."""
    hc, dim = stream.shape[1:]
    key = key.float().unflatten(-1, (hc, dim))
    h = stream.float()
    # normalised per (token, copy) over the hidden dim, not jointly over the copies
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * dim ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp_value).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(stream.dtype)
