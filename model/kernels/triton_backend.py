"""The Triton backend: kernels that read FP8/FP4 weights in their storage formats (CUDA default).

Each method has the reference backend's method of the same name as its twin (``reference.py``);
``tests/test_triton_kernels.py`` holds them against each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..cache_formats import RowsWrite
from ..config import WeightFormat
from ..rope import RotaryTable
from ..routing import RoutingRule
from . import triton_route
from .backend import KernelBackend
from .side_stream import Deferred, SideStream
from .fp4_fragments import fragments_exact, fragments_fit
from .reference import ReferenceKernels
from .triton_bf16_mm import BLOCK_K as BF16_MM_BLOCK_K
from .triton_bf16_mm import bf16_mm
from .triton_decode_mm import decode_mm, fp8_decode_mm
from . import tile_configs, triton_gemv, triton_mma_experts, triton_rms_norm, triton_window_kv
from .triton_moe import BLOCK_K as MOE_BLOCK_K
from .triton_moe import fused_experts
from .triton_moe_sum import moe_sum, swiglu
from .triton_scaled_mm import act_quant, act_quant_bf16, scaled_mm
from .triton_fp4_round_trip import fp4_round_trip
from .triton_hc_coefficients import hc_coefficients
from .triton_index_scores import index_scores
from .triton_mhc import collapse, expand
from .triton_engram import engram_gate as triton_engram_gate
from .triton_ngram_hash import ngram_hash_ids
from .triton_rms_norm import rms_norm
from .triton_rope import rotate_
from .triton_sparse_attention import sparse_attention
from .triton_sublayer_input import sublayer_input
from .triton_top_entries import top_entries
from .weights import ExpertWeights, QuantizedWeight

T = TypeVar("T")


def matrix_vector_kernel(m: int):
    """The kernel module that takes the FP8 products of ``m`` tokens in the matrix-vector form, outside the
    batch-invariant mode: ``triton_gemv`` up to its ``MAX_TOKENS``; None: the decode or prefill form. The
    benchmarks ask it which table a size reads."""
    return triton_gemv if 1 <= m <= triton_gemv.MAX_TOKENS else None


class TritonKernels(KernelBackend):
    """``batch_invariant``: every product in its prefill form, whose rows never depend on M (see
    ``triton_bf16_mm``); otherwise the FP8 products of one or two tokens take the matrix-vector form
    (``triton_gemv``, two projections of one input in one launch) and the others the split-K decode form
    (``triton_decode_mm``) up to ``tile_configs.decode_form_max_tokens`` (the FP8 linears: 256 tokens;
    ``wo_a`` and the head: 64); the routed experts of a step with up to ``tile_configs.MMA_EXPERTS_MAX_PAIRS``
    pairs per expert take ``triton_mma_experts``, all others ``triton_moe``. The sparse attention is one
    launch per layer (``triton_sparse_attention``), where its torch twin takes ~120 small kernels; mHC's coefficients
    take two (``triton_hc_coefficients``) instead of ~140; the window's KV rows one (``triton_window_kv``:
    RMSNorm, RoPE and the FP8 round trip); a sub-layer's input one (``triton_sublayer_input``: mHC's
    collapse and the RMSNorm); RMSNorm, RoPE, the FP8/FP4 round trips, mHC's expand, the shared expert's
    SwiGLU and the MoE's routing and expert sum one each; the
    indexer's scores read each sequence's keys in place (``triton_index_scores``) instead of a
    per-query copy, and its top-k is a threshold search (``triton_top_entries``) instead of two sorts;
    Engram's n-gram hashing is one launch (``triton_ngram_hash``) instead of ~45.

    ``pdl``: the matrix-vector products, the decode form's FP8 products, ``wo_a`` and their split sums, the
    tensor-core experts' chain and the RMSNorm, sub-layer input and SwiGLU launched before products start
    while the kernel before them finishes (programmatic dependent launch, ``triton_dependent_launch``;
    Hopper and later)."""

    name = "triton"

    def __init__(self, batch_invariant: bool = False, pdl: bool = False):
        self.batch_invariant = batch_invariant
        self.pdl = pdl
        # bf16 checkpoints (no quantized weights) are rare: their few products go through torch
        self._plain = ReferenceKernels(batch_invariant=False)
        self._side = SideStream()

    def beside(self, like: torch.Tensor, work: Callable[[], T]) -> Deferred[T]:
        """On CUDA (with ``tile_configs.SIDE_STREAM``): ``work`` on the device's second stream, joined by
        ``result()`` (``side_stream.py``)."""
        if like.device.type != "cuda" or not tile_configs.SIDE_STREAM:
            return super().beside(like, work)
        return self._side.start(like.device, work)

    def _decode_form(self, m: int, fp8: bool = False) -> bool:
        """Whether ``m`` tokens take the decode form: the FP8 linears' (``fp8``) or the other products'."""
        return not self.batch_invariant and 0 < m <= tile_configs.decode_form_max_tokens(fp8)

    def _matrix_vector(self, m: int, *weights: QuantizedWeight):
        """The matrix-vector kernel that takes these FP8 weights' products of ``m`` tokens outside the
        batch-invariant mode (``matrix_vector_kernel``); None: the decode or prefill form."""
        if self.batch_invariant or not all(
                w.fmt is WeightFormat.FP8 and triton_gemv.fits(w.values, w.scales) for w in weights):
            return None
        return triton_gemv.fp8_gemv if matrix_vector_kernel(m) is triton_gemv else None

    def _rounds_apart(self, m: int) -> bool:
        """Whether the quantized linears of ``m`` rows round their activation in a launch of their own (the
        decode and prefill forms; the matrix-vector form rounds it inside the product): then FP8-ready rows
        (``backend.py``) are the round trip, made by the kernel that makes the rows, and those linears skip
        that launch. (A product of few rows that takes the decode form all the same, a weight the
        matrix-vector form does not fit, gets plain rows and rounds them itself; so does every product with
        ``tile_configs.ROUND_TRIP_IN_PRODUCERS`` off.)"""
        return tile_configs.ROUND_TRIP_IN_PRODUCERS and (self.batch_invariant or matrix_vector_kernel(m) is None)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, prepared: bool = False) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        rounded = prepared and self._rounds_apart(rows.shape[0])
        gemv = self._matrix_vector(rows.shape[0], weight)
        if gemv is not None:
            out = gemv(rows, [(weight.values, weight.scales)], quantize=True, pdl=self.pdl)
        elif weight.fmt is WeightFormat.FP8 and self._decode_form(rows.shape[0], fp8=True):
            out = fp8_decode_mm(rows, [(weight.values, weight.scales)], rounded=rounded, pdl=self.pdl)
        elif weight.fmt is WeightFormat.FP8:  # the faster kernel for FP8 (triton_bf16_mm's docstring)
            out = bf16_mm(rows if rounded else act_quant_bf16(rows), weight.values, weight.scales, weight.fmt)
        else:  # (rounded rows quantize to the same products: the round trip is idempotent)
            out = scaled_mm(*act_quant(rows), weight.values, weight.scales, weight.fmt)
        return out.view(*shape[:-1], -1)

    def quantized_linears(self, x: torch.Tensor, weights: Sequence[QuantizedWeight],
                          prepared: bool = False) -> list[torch.Tensor]:
        """Two FP8 projections of a few tokens in one launch (a matrix-vector kernel, or the decode form up to
        ``tile_configs.decode_form_max_tokens``); otherwise one by one."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if len(weights) != 2 or weights[0].in_features != weights[1].in_features or \
                any(w.fmt is not WeightFormat.FP8 for w in weights):
            return super().quantized_linears(x, weights, prepared)
        pair = [(w.values, w.scales) for w in weights]
        gemv = self._matrix_vector(rows.shape[0], *weights)
        if gemv is not None:
            out = gemv(rows, pair, quantize=True, pdl=self.pdl)
        elif self._decode_form(rows.shape[0], fp8=True):
            out = fp8_decode_mm(rows, pair, rounded=prepared and self._rounds_apart(rows.shape[0]), pdl=self.pdl)
        else:
            return super().quantized_linears(x, weights, prepared)
        first = weights[0].out_features
        return [out[:, :first].view(*shape[:-1], -1), out[:, first:].view(*shape[:-1], -1)]

    def grouped_dequantized_linear(self, x: torch.Tensor, weight: QuantizedWeight | torch.Tensor,
                                   fp8_ready: bool = False) -> torch.Tensor:
        t, groups, k = x.shape
        round_trip = fp8_ready and self._rounds_apart(t)
        if not isinstance(weight, QuantizedWeight) or weight.fmt is not WeightFormat.FP8:
            out = self._plain.grouped_dequantized_linear(x, weight)
            return act_quant_bf16(out.reshape(t, -1)).view(out.shape) if round_trip else out
        gemv = self._matrix_vector(t, weight)
        if gemv is not None:  # (no round trip at these sizes: wo_b rounds inside its product)
            out = gemv(x.reshape(t, groups * k), [(weight.values, weight.scales)], quantize=False, groups=groups,
                       pdl=self.pdl)
            return out.view(t, groups, -1)
        if self._decode_form(t):  # the round trip where its splits are added
            out = decode_mm(x.reshape(t, groups * k), weight.values, weight.scales, weight.fmt, groups=groups,
                            round_trip=round_trip, pdl=self.pdl)
        else:
            out = bf16_mm(x.reshape(t, groups * k), weight.values, weight.scales, weight.fmt, groups=groups)
            out = act_quant_bf16(out) if round_trip else out
        return out.view(t, groups, -1)

    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.shape[-1] % BF16_MM_BLOCK_K:
            return self._plain.fp32_linear(x, weight)  # fp32 operands: no exact bf16 product
        mm = decode_mm if self._decode_form(x.shape[0]) else bf16_mm
        return mm(x.contiguous(), weight, None, WeightFormat.BF16, out_dtype=torch.float32)

    def prepare_experts(self, experts: ExpertWeights) -> ExpertWeights:
        """FP4 experts go into the fragment layout (``fp4_fragments.py``: ~2 instructions per value in
        the experts' kernels instead of ~7) when their shapes and scales allow it exactly; any other
        weight keeps the checkpoint's rows, which the kernels also read."""
        weights = (experts.w1, experts.w3, experts.w2)
        if all(isinstance(w, QuantizedWeight) and w.fmt is WeightFormat.FP4 and not w.fragments
               and fragments_fit(w.out_features, w.in_features) and w.in_features % MOE_BLOCK_K == 0
               and fragments_exact(w.scales) for w in weights):
            for w in weights:
                w.to_fragments()
        return experts

    def expert_outputs(self, x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor,
                       pair_weight: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        if not isinstance(experts.w1, QuantizedWeight):
            return self._plain.expert_outputs(x, pair_token, pair_expert, pair_weight, experts)
        weights = pair_weight.float().contiguous()
        pairs = pair_token.shape[0]
        if (not self.batch_invariant and 0 < pairs <= tile_configs.MMA_EXPERTS_MAX_PAIRS * experts.num_experts
                and triton_mma_experts.takes(experts)):
            return triton_mma_experts.mma_experts(x, pair_token, pair_expert, weights, experts, pdl=self.pdl)
        return fused_experts(x, pair_token, pair_expert, weights, experts)

    def sparse_attention(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                         sink: torch.Tensor, scale: float) -> torch.Tensor:
        return sparse_attention(q, pool, index, valid, sink, scale, batch_invariant=self.batch_invariant)

    def sparse_attention_rotated_back(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor,
                                      valid: torch.Tensor, sink: torch.Tensor, scale: float, positions: torch.Tensor,
                                      rope: RotaryTable, rope_dims: int) -> torch.Tensor:
        if not _rope_inside(rope, rope_dims):
            return super().sparse_attention_rotated_back(q, pool, index, valid, sink, scale, positions, rope,
                                                         rope_dims)
        return sparse_attention(q, pool, index, valid, sink, scale, batch_invariant=self.batch_invariant,
                                positions=positions, table=rope.table)

    def hc_coefficients(self, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                        hc: int, iters: int, hc_eps: float,
                        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_coefficients(stream, fn, scale, base, hc, iters, hc_eps, norm_eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_ready: bool = False) -> torch.Tensor:
        round_trip = fp8_ready and self._rounds_apart(x.numel() // max(1, x.shape[-1]))
        return rms_norm(x, weight, eps, pdl=self.pdl,
                        outputs=triton_rms_norm.ROUND_TRIP if round_trip else triton_rms_norm.PLAIN)

    def rms_norm_and_fp8_ready(self, x: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rounds_apart(x.numel() // max(1, x.shape[-1])):
            return rms_norm(x, weight, eps, pdl=self.pdl, outputs=triton_rms_norm.BOTH)
        normed = rms_norm(x, weight, eps, pdl=self.pdl)
        return normed, normed

    def hc_collapse_and_norm(self, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
        return sublayer_input(stream, pre, weight, eps, pdl=self.pdl)

    def hc_collapse_and_norm_fp8_ready(self, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rounds_apart(stream.shape[0]):
            return sublayer_input(stream, pre, weight, eps, pdl=self.pdl, outputs=triton_rms_norm.BOTH)
        normed = sublayer_input(stream, pre, weight, eps, pdl=self.pdl)
        return normed, normed

    def fp8_round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return act_quant_bf16(x.contiguous())

    def window_kv(self, kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  rope: RotaryTable, rope_dims: int, out: torch.Tensor | None = None,
                  ring: RowsWrite | None = None) -> torch.Tensor:
        if rope.table.shape[-1] * 2 != rope_dims or not triton_window_kv.takes(kv.shape[-1], rope_dims):
            return super().window_kv(kv, weight, eps, positions, rope, rope_dims, out, ring)
        store = ring.store if ring is not None else None
        inside = (tile_configs.RING_WRITE_IN_WINDOW_KV and store is not None and store.fused
                  and triton_window_kv.stores(store.codec.fmt))
        rows = triton_window_kv.window_kv(kv, weight, eps, positions, rope.table, out,
                                          ring=(store.data, ring.rows, store.codec.fmt) if inside else None)
        if ring is not None and not inside:
            ring(rows)
        return rows

    def fp4_round_trip(self, x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
        return fp4_round_trip(x, block, e4m3_scale)

    def rotary_fp4_round_trip(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, rope_dims: int,
                              block: int, e4m3_scale: bool) -> torch.Tensor:
        if not _rope_inside(rope, rope_dims):
            return super().rotary_fp4_round_trip(x, positions, rope, rope_dims, block, e4m3_scale)
        return fp4_round_trip(x, block, e4m3_scale, positions=positions, table=rope.table)

    def rotate_(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable,
                inverse: bool = False) -> torch.Tensor:
        return rotate_(x, positions, rope.table, inverse)

    def hc_collapse(self, stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return collapse(stream, pre)

    def hc_expand(self, output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
        return expand(output, residual, post, comb)

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     seq: torch.Tensor) -> torch.Tensor:
        return index_scores(q, weights, keys, seq)

    def index_score_row_elements(self, heads: int, dim: int, entries: int) -> int:
        return entries  # one row of scores (the kernel streams the keys), then [S, E] masks of it

    def top_entries(self, scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
        if scores.dtype != torch.bfloat16:  # the indexer's scores are bf16; anything else takes the sorts
            return self._plain.top_entries(scores, k_per_row, k_max)
        return top_entries(scores, k_per_row, k_max)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, fp8_ready: bool = False) -> torch.Tensor:
        return swiglu(gate, up, limit, pdl=self.pdl, round_trip=fp8_ready and self._rounds_apart(gate.shape[0]))

    def engram_gate(self, stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor,
                    eps: float, clamp_value: float) -> torch.Tensor:
        return triton_engram_gate(stream, key, value, weight, eps, clamp_value)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
        if not triton_route.fuses(rule) or logits.dtype != torch.float32:
            return self._plain.route(logits, bias, rule)
        return triton_route.route(logits, bias, rule)

    def moe_sum(self, routed: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return moe_sum(routed, ids, shared)

    def ngram_hash_ids(self, *args) -> torch.Tensor:
        return ngram_hash_ids(*args)


def _rope_inside(rope: RotaryTable, rope_dims: int) -> bool:
    """Whether a kernel that consumes rotated values takes the rotation itself (``ROPE_IN_CONSUMERS``): the
    table's pairs must be the ``rope_dims`` rotated, as ``rotate_`` rotates them."""
    return tile_configs.ROPE_IN_CONSUMERS and rope.table.shape[-1] * 2 == rope_dims
