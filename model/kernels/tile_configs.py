"""Tile configurations of the Triton kernels, chosen by shape from fixed tables.

Nothing is autotuned while serving, so the first request pays no tuning and every process picks
the same tiles (``benchmarks/kernels.py --tune`` sweeps candidates offline on one H200). Batch
invariance needs every config of a kernel to use the same tensor-core instruction shape, so that
which config a batch gets never changes a row's result: the 64-row side of the instruction is
one side: the weight side for ``triton_scaled_mm`` and the experts (``block_n >= 64``; the experts'
16-token blocks everywhere but in prefill), the token side for ``triton_bf16_mm`` (``block_m >= 64``).
``block_m`` counts tokens (the experts' kernels: the tokens of one expert per block), ``block_n``
output features. The decode form of ``triton_decode_mm`` (``DecodeConfig``) is not batch invariant:
it is used only outside ``--batch-invariant``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tokens per tile
    block_n: int  # output features (weight rows) per tile
    num_warps: int
    num_stages: int


# (largest M, config): the first row whose bound holds is used
_SCALED_MM_TABLE: tuple[tuple[int, TileConfig], ...] = (  # FP4 linears
    (16, TileConfig(16, 64, 4, 4)),  # decode: one 16-token tile, many programs streaming the weight
    (64, TileConfig(64, 64, 4, 4)),
    (1 << 62, TileConfig(128, 128, 8, 3)),  # prefill: tensor-core tiles
)

_MOE_TABLE: tuple[tuple[float, TileConfig], ...] = (  # bound: mean pairs per expert
    # 16 tokens x 64-128 weight rows: the best of the sweep on one H200 (configs within 3% of each
    # other, and bit-identical outputs); prefill: tensor-core tiles, 128 tokens per block once the
    # experts get that many on average (an 8K-token prefill: 10.3 instead of 11.0 ms per layer with 64)
    (0.05, TileConfig(16, 64, 4, 4)),
    (16, TileConfig(16, 128, 4, 3)),
    (64, TileConfig(64, 128, 8, 3)),
    (1 << 62, TileConfig(128, 128, 8, 3)),
)

# the bf16-operand kernel (FP8 linears, wo_a, head) keeps the token side on the 64-row side
# (block_m >= 64 tokens, 4 warps per 64). 256-token prefill tiles for the largest weights (wq_b, wo_a,
# wo_b) measured 6% faster alone, but the whole 8K-token prefill ~1 ms slower (on one H200): not kept
_BF16_MM_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (64, TileConfig(64, 32, 4, 4)),  # decode: narrow tiles along N so enough programs stream the weight
    (256, TileConfig(64, 64, 4, 4)),
    (1 << 62, TileConfig(128, 128, 8, 3)),
)


def _pick(table: tuple[tuple[int, TileConfig], ...], size: float) -> TileConfig:
    for bound, cfg in table:
        if size <= bound:
            return cfg
    raise AssertionError("unreachable: the last row takes every size")


def scaled_mm_config(m: int) -> TileConfig:
    return _pick(_SCALED_MM_TABLE, m)


def moe_config(pairs_per_expert: float) -> TileConfig:
    return _pick(_MOE_TABLE, pairs_per_expert)


def bf16_mm_config(m: int) -> TileConfig:
    return _pick(_BF16_MM_TABLE, m)


@dataclass(frozen=True)
class DecodeConfig:
    """A config of ``triton_decode_mm`` (the token tile is M rounded up to a power of two, >= 16)."""

    block_w: int  # weight rows (output features) per program: the tensor cores' 64-row side
    block_k: int  # K columns per step (the unit that a split is a whole number of)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # split K until there are this many programs per SM (or no more K steps)
    max_splits: int = 64
    one_wave: bool = False  # at most ``programs_per_sm`` per SM: no partial second wave of programs


# a launch's ``(output rows, K)`` -> its own table (rows of ``(largest M, config)``), read before the table by
# M (``decode_mm_config``, ``fp8_decode_config``, ``gemv_config``)
LaunchTables = dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]]


def _pick_for_launch(by_shape: LaunchTables, table: tuple[tuple[int, DecodeConfig], ...], m: int, rows: int,
                     k: int) -> DecodeConfig:
    """The first row of the launch's own table (``by_shape[(rows, k)]``) whose bound holds, else ``table``'s."""
    for bound, cfg in by_shape.get((rows, k), ()):
        if m <= bound:
            return cfg
    return _pick(table, m)


# (largest M, config): ``decode_mm`` (the grouped wo_a, the bf16 head), the best single config over a
# layer's FP8 linears in the sweep of ``benchmarks/kernels.py --tune`` on one H200 (docs/benchmarks-log.md)
# when they all took this kernel
_DECODE_MM_TABLE: tuple[tuple[int, DecodeConfig], ...] = (
    # one token's small bf16 products (router, compressor: 384-1024 x 5120): at most 8 splits. With
    # 4 programs per SM they took 40 one-step splits and their sum ~9 µs; this ~5.1-7.8 µs on one H200
    # (the head, 2,020 row tiles, takes one split either way)
    (1, DecodeConfig(64, 128, 4, 3, 1, max_splits=8)),
    (16, DecodeConfig(64, 128, 4, 3, 4)),
    (64, DecodeConfig(128, 256, 8, 3, 2)),
)


# the FP8 linears (``fp8_decode_mm``: ``decode_mm``'s kernel with both scales folded into bf16 operands). Four
# of the layer's shapes (wo_b, wq_b, w1, wkv) on one H100, each call timed alone in a CUDA graph, against the
# block-order kernel this replaced (118.4 µs at 64 tokens, 85.7 at 16): 128 rows x 128 columns, 4 warps, 3
# stages, 2 programs per SM took 99.6 / 78.6 µs, 64 rows at 4 per SM 114.8 / 73.7 (docs/benchmarks-log.md)
# (ptxas runs this tile's wgmmas one at a time, the 128-row tiles' not; still, a layer's nine projections at 16
# tokens on one H100 took 107.7 µs here against 111.9 with 128 rows and 116.4 on two warps)
_FP8_DECODE_16_TOKENS = DecodeConfig(64, 128, 4, 3, 4, one_wave=True)
_FP8_DECODE_TABLE: tuple[tuple[int, DecodeConfig], ...] = (
    (16, _FP8_DECODE_16_TOKENS),
    (64, DecodeConfig(128, 128, 4, 3, 2, one_wave=True)),
    # 65-256 tokens in one token tile (the weight expanded once for all of them; 256 tokens: 64-column steps,
    # what fits in shared memory): seven of a layer's shapes on one H200 took 164.4 µs at 128 tokens and
    # 262.4 at 256, against 285.3 and 372.7 in the prefill form (docs/benchmarks-log.md)
    (256, DecodeConfig(128, 128, 8, 3, 1, one_wave=True)),
)


def decode_form_max_tokens(fp8: bool) -> int:
    """The most tokens that ``triton_decode_mm`` takes: for the FP8 linears, or for the other products."""
    return (_FP8_DECODE_TABLE if fp8 else _DECODE_MM_TABLE)[-1][0]


# Launches' own rows for the decode form, read before the tables above (``rows``: the launch's output rows, a
# grouped weight's groups x N or a pair's two N): the picks of ``benchmarks/kernels.py --tune-layer-gemv --m
# 16`` / ``64`` / ``128,256`` (each launch of a V4.1-Flash layer timed alone under
# ``layer_gemv_tune.decode_candidates``: 28 configs up to 64 tokens, 16 above) on one H100, where a pick gained
# more than 0.3 µs (at 128-256 tokens: more than 1 µs, the two pairs). The layer graph there: 98.0 -> 95.3 µs at
# 16 tokens, 140.4 -> 125.7 at 64, 198.5 -> 191.2 at 128 and 328.1 -> 321.1 at 256 with every launch's pick
# (docs/benchmarks-log.md). A launch's first row whose bound holds is taken, so a launch with a row for 64 tokens
# repeats the table's 16-token config where it keeps it. Not swept on an H200
_FP8_DECODE_BY_SHAPE: LaunchTables = {
    # wq_a with wkv: 12.8 -> 11.7 µs at 64 tokens, 15.5 -> 14.1 at 128, 23.9 -> 23.1 at 256
    (1792, 5120): ((16, _FP8_DECODE_16_TOKENS), (64, DecodeConfig(64, 128, 4, 3, 4)),
                   (128, DecodeConfig(64, 128, 4, 4, 1, one_wave=True)),
                   (256, DecodeConfig(64, 128, 4, 3, 2, one_wave=True))),
    # wq_b with the indexer's: 40.3 -> 33.6 µs at 64 tokens, 58.3 -> 53.1 at 128, 87.9 -> 82.2 at 256
    (36864, 1280): ((16, _FP8_DECODE_16_TOKENS), (64, DecodeConfig(64, 128, 4, 3, 8, one_wave=True)),
                    (128, DecodeConfig(64, 64, 4, 3, 2, one_wave=True)),
                    (256, DecodeConfig(64, 128, 4, 3, 2, one_wave=True))),
    (5120, 8192): ((16, DecodeConfig(64, 256, 4, 4, 2, one_wave=True)),),  # wo_b: 21.6 -> 20.7 µs at 16 tokens
    # the shared w2: 9.9 -> 9.5 µs at 16 tokens, 12.9 -> 12.2 at 64
    (5120, 2304): ((16, DecodeConfig(64, 256, 4, 3, 2, one_wave=True)),
                   (64, DecodeConfig(64, 128, 4, 3, 2, one_wave=True))),
}
_DECODE_MM_BY_SHAPE: LaunchTables = {
    # the grouped wo_a: 18.8 -> 17.1 µs at 16 tokens, 28.1 -> 22.4 at 64
    (8192, 4096): ((16, DecodeConfig(64, 256, 4, 3, 2, one_wave=True)),
                   (64, DecodeConfig(128, 128, 4, 3, 2, one_wave=True))),
}


def decode_mm_config(m: int, rows: int = 0, k: int = 0) -> DecodeConfig:
    """``decode_mm``'s config for ``m`` tokens times ``rows`` output rows of K = ``k`` (one launch)."""
    return _pick_for_launch(_DECODE_MM_BY_SHAPE, _DECODE_MM_TABLE, m, rows, k)


def fp8_decode_config(m: int, rows: int = 0, k: int = 0) -> DecodeConfig:
    """``fp8_decode_mm``'s config for ``m`` tokens times ``rows`` output rows of K = ``k`` (one launch)."""
    return _pick_for_launch(_FP8_DECODE_BY_SHAPE, _FP8_DECODE_TABLE, m, rows, k)


# (largest M, config): ``triton_gemv`` (one or two tokens on the CUDA cores). ``block_w`` divides 32 (a
# program's rows share one row of the weight's 32x32 scales), ``block_k`` is a step's columns,
# ``num_stages`` 1: the weight loaded into registers one step ahead; 2 or more: streamed through a ring
# of that many tiles in shared memory by the tensor memory accelerator. 32 rows x 512 columns, 4 warps,
# a ring of 3, K split only until there is one program per SM: a layer's nine FP8 projections in one
# CUDA graph took 78.6 µs on one H100 (70% of its memory limit) against 86.9 for the registers' best
# (32 x 128, 4 programs per SM), the other rings measured 80.4-109.7 (docs/benchmarks-log.md).
# ``benchmarks/kernels.py --gemv-configs`` times the layer graph with given configs, ``--tune --m 1``
# sweeps candidates per projection. Two tokens take the same config (one H100: 85.4 µs for the layer, 64%;
# 256-column steps 88.3 µs)
_GEMV_TABLE: tuple[tuple[int, DecodeConfig], ...] = (
    (2, DecodeConfig(32, 512, 4, 3, 1)),
)

# One launch's own table, read before the table above: ``(rows, K)`` -> rows of the same form, ``rows`` the
# launch's output rows (a grouped weight's groups x N, plus a second weight's N); an M past the launch's
# last row takes the table above. ``benchmarks/kernels.py --tune-layer-gemv`` times each launch of a
# V4.1-Flash layer's one-token graph alone under 42 ring candidates, then the layer graph with each
# launch's best. On one H100 the table's config was the best or within 0.2 µs for all six launches (the
# graph 78.5 against 78.7 µs: noise), so no entry is kept; an H200 has not run the sweep yet
# (docs/benchmarks-log.md)
_GEMV_BY_SHAPE: LaunchTables = {}

# a weight the accelerator cannot stream (its start not 16-byte aligned) takes the registers' best
# config instead (the 512-column step held in registers spills)
GEMV_IN_REGISTERS = DecodeConfig(32, 128, 4, 1, 4)


def gemv_config(m: int, rows: int = 0, k: int = 0) -> DecodeConfig:
    """``triton_gemv``'s config for ``m`` tokens times ``rows`` output rows of K = ``k`` (one launch)."""
    return _pick_for_launch(_GEMV_BY_SHAPE, _GEMV_TABLE, m, rows, k)


# Outside the batch-invariant mode the FP8 linears of one or two tokens take ``triton_gemv``, those of 3 to
# 256 tokens the decode form (``triton_decode_mm``; the grouped ``wo_a`` up to 64) and larger ones the prefill
# form (``triton_bf16_mm``). At 3-8 tokens the decode form, with both scales folded into its bf16 operands and
# FP8-ready rows, measured faster than the tensor cores fed from registers on one H100 (a layer's FP8
# projections in one graph: 96.4 against 110.3 µs at 8 tokens; docs/benchmarks-log.md)

# FP8-ready rows (``backend.py``): the kernels that make the input of a quantized linear of the decode or
# prefill form (from 3 tokens on: RMSNorm, the SwiGLU, the grouped ``wo_a``'s split sums) round it through
# FP8 themselves, and the product skips its own round trip's launch; off: every product rounds its own input
# (the benchmarks' comparison)
ROUND_TRIP_IN_PRODUCERS = True

# mHC's coefficients, the shared expert, the compressors and Engram's lookups run beside the launches that
# follow them, on a second stream of the device (``side_stream.py``: a CUDA graph with two branches); off:
# everything on the caller's stream (the benchmarks' comparison). On one H100 (``benchmarks/decode.py --preset
# v41-flash-L8 --kernels triton-noside,triton --context 1024``, one process) the step took 2.49 -> 2.41 ms at
# batch 1, 5.35 -> 5.30 at 8, 11.29 -> 11.07 at 32, 16.27 -> 16.09 at 64 and 29.58 -> 29.07 at 256 (with only
# the coefficients and the shared expert beside: 2.48 / 5.40 / 16.20 at batch 1 / 8 / 64, another process): the
# overlap outweighs what a second stream costs every graph replay (``workers/worker_stream.py``;
# docs/benchmarks-log.md)
SIDE_STREAM = True

# RoPE in the launches that consume it: the FP4 round trips of the index queries and the compressor's keys
# and entries rotate their input as they load it, and where a few rows split their attention the combining
# launch rotates the output back (the bits of ``rotate_`` apart); off: ``rotate_``'s own launch for each
# (the benchmarks' comparison). On one H100 the index queries' two launches took 3.76 /
# 4.23 / 4.63 µs at 1 / 16 / 64 tokens, the one 3.17 / 3.53 / 4.16 (``benchmarks/small_kernels.py``). The
# sparse attention's queries and output were tried too and measured slower (64.2 against 56.2 µs at 16 rows:
# each program's rotation adds its dependent loads and barriers to a launch of about one wave;
# docs/benchmarks-log.md): they keep ``rotate_``'s launches
ROPE_IN_CONSUMERS = True

# A decode step's window rows stored in the rings by the launch that makes them (``triton_window_kv``'s ring):
# one launch fewer per layer; off: the cache's own write launch, at the same point of the step (the benchmarks'
# comparison). On one H100 (``benchmarks/decode.py --kernels triton-ringapart,triton``) the step took 2.44 -> 2.43
# ms at batch 1, 5.29 -> 5.28 at 8, 16.52 -> 16.50 at 64, and the same graph replay at 256 (docs/benchmarks-log.md)
RING_WRITE_IN_WINDOW_KV = True

# The routed experts take ``triton_mma_experts`` (the tensor cores fed from registers, blocks of 8 pairs)
# outside the batch-invariant mode while a step has at most this many pairs per expert on average; 0:
# never. On one H200 (``benchmarks/kernels.py --kernels moe --tensor-core-experts 0`` / ``8``, 384
# experts, uniform routing; docs/benchmarks-log.md) they took 52.2 / 270.6 / 1,256 / 1,995 us at 1 / 8 / 64 /
# 256 tokens (0.016 to 4 pairs per expert) where ``triton_moe`` took 64.8 / 331.1 / 1,593 / 2,455 us;
# more pairs per expert were not measured
MMA_EXPERTS_MAX_PAIRS = 4.0

# (mean pairs per expert, config): ``triton_mma_experts``. ``num_warps`` warps per program (each 32 rows
# of w1 and w3, or 64 of w2), K split until there are ``programs_per_sm`` programs per SM; ``block_w``
# and ``block_k`` are set by the kernels (their rows per program, one 64-column step). A starting point
# for the sweep: a warp keeps ~2.5 KB of loads in flight (four groups' words and scales one step ahead),
# so 4 programs of 4 warps per SM hold ~40 KB, past the ~25 KB an SM needs at full bandwidth (at the 96
# registers per thread the GPU's Triton 3.6 gives both kernels, 5 such programs fit). The sweep on one
# H200 (1-8 warps x 2-16 programs per SM) found nothing faster at one token and within 0.5% / 2.4% at
# 64 / 256 tokens
_MMA_EXPERTS_TABLE: tuple[tuple[float, DecodeConfig], ...] = (
    (1 << 62, DecodeConfig(128, 64, 4, 1, 4)),
)


def mma_experts_config(pairs_per_expert: float) -> DecodeConfig:
    return _pick(_MMA_EXPERTS_TABLE, pairs_per_expert)


# Steps of at most this many pairs skip the pair sort in ``triton_mma_experts``: each pair is a block of
# its own, in pair order (a one-token step's top-6 experts are distinct; pairs that share an expert
# are still right, each reading the expert's weight). Saves the sort's launch, a one-program kernel
# that sits between the activation's quantization and gate/up in every MoE layer of a decode step. On one
# H100 (``benchmarks/kernels.py --kernels moe --m 1 --unsorted-pairs 0`` / default; docs/benchmarks-log.md) a
# one-token step's experts took 53.6 instead of 59.3 us
MMA_EXPERTS_UNSORTED_PAIRS = 8
