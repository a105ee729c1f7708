"""Tile configurations of the Triton kernels, chosen by shape from a fixed table.

The table was tuned offline on one H200 (``benchmarks/kernels.py --tune``); nothing is autotuned
while serving, so the first request pays no tuning and every process picks the same tiles. Every
config keeps ``BLOCK_M >= 64`` and ``num_warps`` a multiple of 4, so all of them use the same
tensor-core instruction shape and sum K in the same order: which config a shape gets never changes
a row's result (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (largest M, config): the first row whose M bound holds is used
_GEMM_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (64, TileConfig(64, 32, 4, 4)),  # decode: small tiles along N so enough programs stream the weight
    (256, TileConfig(64, 64, 4, 4)),
    (1 << 62, TileConfig(128, 128, 8, 3)),  # prefill: tensor-core tiles
)

_MOE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (8, TileConfig(64, 32, 4, 4)),  # at most a few tokens per expert: stream the experts' weights
    (1 << 62, TileConfig(64, 64, 4, 4)),
)


def gemm_config(m: int, n: int, k: int) -> TileConfig:
    for bound, cfg in _GEMM_TABLE:
        if m <= bound:
            return cfg
    raise AssertionError("unreachable: the last row takes every M")


def moe_config(pairs_per_expert: float) -> TileConfig:
    for bound, cfg in _MOE_TABLE:
        if pairs_per_expert <= bound:
            return cfg
    raise AssertionError("unreachable: the last row takes every M")
