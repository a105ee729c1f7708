"""The kernel interface: the products (and the few elementwise chains) a backend may implement its own way.

The model's modules call these methods and never look at which backend they hold. Two backends
exist: ``reference`` (``reference.py``: the arithmetic proven equal to DeepSeek's reference,
default on CPU, what ``parity`` uses) and ``triton`` (``triton_backend.py``: GPU kernels that
read the storage formats directly, default on CUDA). The fp32 products of bf16 operands (the head, the router, the
compressor's pooling) are in it for the head's size (the largest single weight); the sparse attention for its launches (~120 torch kernels per layer)
and the indexer's scores for their intermediate (a per-query copy of the keys). A few elementwise
chains are in it for their launch counts: each is many tiny torch kernels (mHC's coefficients ~7
and a Sinkhorn split ~135 per call, an FP4 round trip ~28, mHC's collapse and expand 4 and 7, RMSNorm and RoPE 6, the
MoE's routing ~11, SwiGLU 7 and expert sum ~12, Engram's n-gram hashing ~45 and its gated add ~15), which a decode step would otherwise
spend its time launching.
Other plain bf16 products (the compressor's and indexer's other weights) are not: both
backends run them through torch (``model/gemm.py``).

FP8-ready rows. An FP8 or FP4 linear first rounds its activation through FP8 per 32 (the reference's
``act_quant``). A backend that does that in a launch of its own may let the kernel that makes the
activation do it instead, on the values it already holds: ``rms_norm``, ``swiglu`` and
``grouped_dequantized_linear`` called with ``fp8_ready=True`` (and ``rms_norm_and_fp8_ready``'s second
output) return their rows as this backend's quantized linears take them with ``prepared=True``. Such
rows go only to those linears; the model asks for them only where the consumers' weights are quantized.
What they hold is the backend's choice by the number of rows: the Triton backend's FP8 round trip
where its products of that many rows round in a launch of their own, the plain output where they round
inside the product's kernel; the reference's always the plain output. Either way the products are the
same bits, since the round trip is idempotent (``fp8_qdq(fp8_qdq(x)) == fp8_qdq(x)``, ``tests/test_quant.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .side_stream import Deferred
from .weights import ExpertWeights, QuantizedWeight

T = TypeVar("T")

if TYPE_CHECKING:
    from ..cache_formats import RowsWrite
    from ..rope import RotaryTable
    from ..routing import RoutingRule


class KernelBackend(ABC):
    name: str

    @abstractmethod
    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, prepared: bool = False) -> torch.Tensor:
        """``x [..., K]`` bf16 times an FP8/FP4 weight ``[N, K]`` -> bf16 ``[..., N]``.

        The reference's ``fp8_gemm``/``fp4_gemm``: ``x`` is FP8-quantized in groups of 32 (UE8M0
        scales), products accumulate in fp32. ``prepared``: ``x`` is FP8-ready rows (module docstring)."""

    def quantized_linears(self, x: torch.Tensor, weights: Sequence[QuantizedWeight],
                          prepared: bool = False) -> list[torch.Tensor]:
        """``quantized_linear(x, w, prepared)`` for each weight: projections of one input (a backend may
        run them in one launch)."""
        return [self.quantized_linear(x, w, prepared) for w in weights]

    @abstractmethod
    def grouped_dequantized_linear(self, x: torch.Tensor, weight: QuantizedWeight | torch.Tensor,
                                   fp8_ready: bool = False) -> torch.Tensor:
        """``x [T, G, K]`` bf16 times group ``g``'s slice of a weight ``[G * R, K]`` -> bf16 ``[T, G, R]``.

        The grouped output projection (``wo_a``): the reference multiplies the bf16 activation
        (not quantized) by the exactly dequantized bf16 weight (or a bf16 checkpoint's weight).
        ``fp8_ready``: the output as FP8-ready rows (module docstring), for ``wo_b`` alone."""

    @abstractmethod
    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 ``x @ weight.T`` of rows ``x [R, K]`` and a plain weight ``[N, K]`` -> ``[R, N]``: the
        head's logits, the router's scores and the compressor's pooling projections.

        The reference multiplies fp32 copies of both. With bf16 operands (the checkpoint's) the
        products are exact in fp32, so a backend may multiply the bf16 values with fp32 accumulation
        instead of holding fp32 copies; only the order of the sums may differ."""

    def prepare_experts(self, experts: ExpertWeights) -> ExpertWeights:
        """Called once per layer at load: a backend may re-lay out the experts' bytes for its kernels
        (same memory); the reference arithmetic reads the checkpoint's layout as it is."""
        return experts

    @abstractmethod
    def expert_outputs(self, x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor,
                       pair_weight: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Routed expert outputs, one row per (token, expert) pair -> bf16 ``[P, D]``.

        ``x [N, D]`` bf16 token rows; per pair: ``pair_token [P]`` (row of ``x``), ``pair_expert
        [P]`` (index into ``experts``' stack, i.e. global id minus ``first_expert``; a value
        outside the stack means the pair is not this rank's and its row is left zero),
        ``pair_weight [P]`` fp32 routing weight. Each pair computes the clamped SwiGLU expert with
        the routing weight applied to the hidden activation before the down projection."""

    @abstractmethod
    def sparse_attention(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                         sink: torch.Tensor, scale: float) -> torch.Tensor:
        """Each query row's attention over its own listed KV rows, with a sink -> bf16 ``[T, H, D]``.

        ``q [T, H, D]`` bf16; the rows row ``t`` lists are ``pool[index[t]]`` (``pool [R, D]`` bf16,
        each distinct row once; ``index [T, L]`` integer; K and V are the same vector); ``valid [T, L]``
        bool (False: a hole, whatever its index); ``sink [H]`` fp32. ``sparse_attention_padded``'s arithmetic
        (``model/sparse_attention.py``): an online softmax over blocks of 64 listed entries (the list
        padded with holes to whole blocks), per block scores ``q . kv`` in fp32 (bf16 products), holes
        at -inf, times ``scale``; the running max (from -1e30) rescales the fp32 sum of ``p = exp(scores -
        max)`` and the fp32 accumulation of ``bf16(p) . kv``; at the end ``exp(sink[h] - max)`` joins the
        sum only (unscaled) and the output is ``bf16(acc / sum)``. A row without a valid entry yields
        zeros, and padding a list with holes changes no bit of its row."""

    def sparse_attention_rotated_back(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor,
                                      valid: torch.Tensor, sink: torch.Tensor, scale: float, positions: torch.Tensor,
                                      rope: "RotaryTable", rope_dims: int) -> torch.Tensor:
        """``sparse_attention``, then its output's last ``rope_dims`` dims rotated back (``rotate_`` with
        ``inverse`` at ``positions``; a backend may do it inside the attention's launches, with the same bits)."""
        o = self.sparse_attention(q, pool, index, valid, sink, scale)
        self.rotate_(o[..., -rope_dims:], positions, rope, inverse=True)
        return o

    @abstractmethod
    def hc_coefficients(self, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                        hc: int, iters: int, hc_eps: float,
                        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC coefficients of the stream ``[T, hc, D]`` bf16 -> pre ``[T, hc]``, post ``[T, hc]``, comb
        ``[T, hc, hc]`` fp32: the raw mixes ``model.mhc.mixes`` (``fn [(2 + hc) * hc, hc * D]`` fp32 times
        each token's flattened stream, times its rsqrt mean square), then ``model.mhc.split_sinkhorn``'s
        arithmetic (sigmoids, a softmax, then ``iters`` column/row normalisations, each token alone)."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_ready: bool = False) -> torch.Tensor:
        """RMSNorm of each row of ``x [..., D]`` (bf16 or fp32) in fp32, times ``weight [D]``, back in
        ``x``'s dtype (``model.layers.rms_norm``). ``fp8_ready``: as FP8-ready rows (module docstring;
        bf16 ``x``), for quantized linears alone."""

    def rms_norm_and_fp8_ready(self, x: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x, weight, eps), rms_norm(x, weight, eps, fp8_ready=True))``: normed rows that go to
        quantized linears and elsewhere too (a backend may make both in one launch)."""
        return self.rms_norm(x, weight, eps), self.rms_norm(x, weight, eps, fp8_ready=True)

    def hc_collapse_and_norm(self, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
        """``rms_norm(hc_collapse(stream, pre), weight, eps)``: mHC's collapse of the stream, normed (a backend
        may do both in one launch, with the same bits)."""
        return self.rms_norm(self.hc_collapse(stream, pre), weight, eps)

    def hc_collapse_and_norm_fp8_ready(self, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``rms_norm_and_fp8_ready(hc_collapse(stream, pre), weight, eps)``: a sub-layer's input, normed and
        as its FP8 linears take it (a backend may do it in one launch, with the same bits)."""
        return self.rms_norm_and_fp8_ready(self.hc_collapse(stream, pre), weight, eps)

    def window_kv(self, kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  rope: "RotaryTable", rope_dims: int, out: torch.Tensor | None = None,
                  ring: "RowsWrite | None" = None) -> torch.Tensor:
        """The attention's KV rows from ``wkv``'s output ``kv [T, D]`` bf16: ``rms_norm`` with ``weight``,
        ``rotate_`` of the last ``rope_dims`` dims at ``positions``, then ``fp8_round_trip`` (a backend may
        do the three in one launch, with the same bits); into ``out [T, D]`` (contiguous) if given;
        ``ring``: the rows also written there (the window's ring; a backend may store them in the same
        launch, with the same bytes)."""
        kv = self.rms_norm(kv, weight, eps)
        self.rotate_(kv[:, -rope_dims:], positions, rope)
        rows = self.fp8_round_trip(kv)
        rows = rows if out is None else out.copy_(rows)
        if ring is not None:
            ring(rows)
        return rows

    @abstractmethod
    def fp8_round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[T, K]`` through FP8 e4m3 with a UE8M0 scale per 32 values and back, exactly
        (``model.quant.fp8_qdq``; the sliding-window KV)."""

    @abstractmethod
    def fp4_round_trip(self, x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
        """bf16 ``[..., K]`` through FP4 e2m1 and back, exactly (``model.quant.fp4_qdq``): groups of 32
        with UE8M0 scales (index queries and keys) or of 16 with E4M3 scales (compressed KV)."""

    def rotary_fp4_round_trip(self, x: torch.Tensor, positions: torch.Tensor, rope: "RotaryTable", rope_dims: int,
                              block: int, e4m3_scale: bool) -> torch.Tensor:
        """``rotate_`` of the last ``rope_dims`` dims of ``x`` (``[T, K]`` or ``[T, H, K]``; in place, or not),
        then ``fp4_round_trip`` (a backend may do both in one launch, with the same bits)."""
        self.rotate_(x[..., -rope_dims:], positions, rope)
        return self.fp4_round_trip(x, block, e4m3_scale)

    @abstractmethod
    def rotate_(self, x: torch.Tensor, positions: torch.Tensor, rope: "RotaryTable",
                inverse: bool = False) -> torch.Tensor:
        """RoPE in place: the bf16 view ``x [T, R]`` or ``[T, H, R]`` (pairs of its last dim as complex
        numbers) times ``rope``'s rotation at ``positions [T]`` (conjugated with ``inverse``), in fp32
        (``model.rope.RotaryTable.rotate_``); returns ``x``."""

    @abstractmethod
    def hc_collapse(self, stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """mHC: the copies of ``stream [T, hc, D]`` weighted by ``pre [T, hc]``, summed in fp32
        (``model.mhc.collapse``) -> ``[T, D]``."""

    @abstractmethod
    def hc_expand(self, output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
        """mHC: a sub-layer's ``output [T, D]`` spread over the copies by ``post [T, hc]`` plus the
        ``residual [T, hc, D]`` mixed by ``comb [T, hc, hc]``, in fp32 (``model.mhc.expand``)."""

    @abstractmethod
    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     seq: torch.Tensor) -> torch.Tensor:
        """The indexer's scores of every query against its own sequence's keys -> bf16 ``[T, E]``.

        ``q [T, H, d]`` bf16 index queries, ``weights [T, H]`` bf16 head weights, ``keys [B, E, d]``
        bf16 (each sequence's index keys), ``seq [T]`` (each query's row of ``keys``):
        ``sum_h weights[t, h] * relu(q[t, h] . keys[seq[t], e])`` with the reference's bf16 roundings
        (the dot product, the weighted value, the sum over heads)."""

    @abstractmethod
    def index_score_row_elements(self, heads: int, dim: int, entries: int) -> int:
        """Elements of the largest temporary that ``index_scores`` (and the selection after it) makes per
        query against ``entries`` keys: the indexer scores a long prefill a slice of queries at a time,
        sized by it (``model.indexer.SCORE_ELEMENTS``)."""

    @abstractmethod
    def top_entries(self, scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
        """The indexer's top-k: per row of ``scores [S, E]``, the ``k_per_row [S]`` highest (ties: the
        lower entry) as entry ids in increasing order in the first columns of ``[S, k_max]`` int64, the
        others 0 (``model.indexer.top_entries``: exact, every backend selects the same entries)."""

    @abstractmethod
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, fp8_ready: bool = False) -> torch.Tensor:
        """The shared expert's clamped SwiGLU: bf16 ``gate``, ``up`` ``[N, I]`` -> bf16 ``silu(gate) * up``
        in fp32, ``up`` clamped to ``[-limit, limit]`` and ``gate`` from above (when ``limit > 0``).
        ``fp8_ready``: as FP8-ready rows (module docstring), for the down projection alone."""

    @abstractmethod
    def ngram_hash_ids(self, compressed: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                       offset: torch.Tensor, slot: torch.Tensor, history: torch.Tensor, pad_id: int,
                       multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Engram's n-gram hash ids ``[T, layers, (n - 1) * heads]`` int64 (``model.engram.ngram_hash_ids``,
        integer arithmetic: every backend gives the same ids)."""

    @abstractmethod
    def engram_gate(self, stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor,
                    eps: float, clamp_value: float) -> torch.Tensor:
        """Engram's gated add of the looked-up ``value [T, D]`` to each copy of ``stream [T, hc, D]``,
        gated by the normalised dot product of the copy with its ``key`` (``model.engram.engram_gate``;
        fp32 inside, bf16 out)."""

    @abstractmethod
    def route(self, logits: torch.Tensor, bias: torch.Tensor, rule: "RoutingRule") -> tuple[torch.Tensor, torch.Tensor]:
        """The router's rule on fp32 ``logits [N, E]`` with its ``bias [E]`` -> (weights ``[N, k]`` fp32,
        expert ids ``[N, k]``) in descending biased-score order (``model.routing.route``)."""

    @abstractmethod
    def moe_sum(self, routed: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """A token's routed outputs ``routed [N, k, D]`` summed in fp32 in increasing expert id (``ids
        [N, k]``), then the shared expert's ``shared [N, D]`` added -> bf16 ``[N, D]`` (the reference's
        order, ``model.moe.combine_routed``)."""

    def beside(self, like: torch.Tensor, work: Callable[[], T]) -> Deferred[T]:
        """Start ``work()``, device work whose inputs are ready now, on ``like``'s device; what the caller
        enqueues before ``result()`` may run at the same time (``side_stream.py``). Its outputs are the
        same bits either way. This backend runs it at once."""
        return Deferred(work())
