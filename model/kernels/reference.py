"""The reference backend: DeepSeek's reference arithmetic, on any device.

Weights stay in their storage formats; each call expands exactly the weight it multiplies (e4m3
or e2m1 values and fp32 scales, which is exact) and frees the expansion when it returns. With
``batch_invariant`` every row is its own product, so a row's result never depends on its batch
(what the engine's CPU default needs); without it, rows are multiplied together, as the
reference does in a prefill (what ``parity`` needs to be bit-exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engram import engram_gate, ngram_hash_ids
from ..gemm import block_scaled_linear, dense_linear
from ..indexer import top_entries
from ..layers import rms_norm
from ..quant import fp4_qdq, fp8_qdq
from ..rope import RotaryTable
from ..routing import RoutingRule, route
from ..mhc import collapse, expand, mixes, split_sinkhorn
from ..moe import combine_routed
from ..sparse_attention import sparse_attention_padded
from .backend import KernelBackend
from .weights import ExpertWeights, QuantizedWeight


class ReferenceKernels(KernelBackend):
    name = "reference"

    def __init__(self, batch_invariant: bool):
        self.batch_invariant = batch_invariant

    # FP8-ready rows (``backend.py``) are the plain rows here: these products round their activation themselves
    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, prepared: bool = False) -> torch.Tensor:
        return block_scaled_linear(x, weight.unscaled_values(), weight.row_scales(), self.batch_invariant)

    def grouped_dequantized_linear(self, x: torch.Tensor, weight: QuantizedWeight | torch.Tensor,
                                   fp8_ready: bool = False) -> torch.Tensor:
        t, groups, _ = x.shape
        w = weight.dequantized() if isinstance(weight, QuantizedWeight) else weight
        w = w.view(groups, -1, x.shape[-1])
        if self.batch_invariant:
            # one [1, K] x [K, R] product per (token, group), as in a reference decode step; the
            # group's weight is broadcast over the tokens (stride 0), not copied
            return torch.stack([torch.bmm(x[:, g].unsqueeze(1), w[g].t().unsqueeze(0).expand(t, -1, -1)).squeeze(1)
                                for g in range(groups)], dim=1)
        return torch.einsum("tgd,grd->tgr", x, w)

    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dense_linear(x.float(), weight.float(), self.batch_invariant)

    def expert_outputs(self, x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor,
                       pair_weight: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        out = torch.zeros(pair_token.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
        num = experts.num_experts
        local = torch.where((pair_expert >= 0) & (pair_expert < num), pair_expert, num)
        for e, count in enumerate(torch.bincount(local, minlength=num + 1)[:num].tolist()):
            if count == 0:
                continue
            pairs = torch.nonzero(pair_expert == e).squeeze(1)  # in pair order: token order for one expert
            out[pairs] = self._expert(x[pair_token[pairs]], pair_weight[pairs, None], experts, e)
        return out

    def sparse_attention(self, q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                         sink: torch.Tensor, scale: float) -> torch.Tensor:
        return sparse_attention_padded(q, pool[index], valid, sink, scale)

    def _expert(self, x: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, e: int) -> torch.Tensor:
        """The reference's clamped SwiGLU expert on rows ``x``; ``weights [n, 1]`` scale the hidden state."""
        gate = self._project(x, experts.w1, e).float()
        up = self._project(x, experts.w3, e).float()
        limit = experts.swiglu_limit
        if limit > 0:
            up = torch.clamp(up, min=-limit, max=limit)
            gate = torch.clamp(gate, max=limit)
        hidden = weights * (F.silu(gate) * up)
        return self._project(hidden.to(x.dtype), experts.w2, e)

    def _project(self, x: torch.Tensor, stack, e: int) -> torch.Tensor:
        if isinstance(stack, QuantizedWeight):
            return self.quantized_linear(x, stack[e])
        return dense_linear(x, stack[e], self.batch_invariant)

    def hc_coefficients(self, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                        hc: int, iters: int, hc_eps: float,
                        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_sinkhorn(mixes(stream, fn, norm_eps, self.batch_invariant), scale, base, hc, iters, hc_eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_ready: bool = False) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rms_norm_and_fp8_ready(self, x: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        normed = rms_norm(x, weight, eps)
        return normed, normed

    def fp8_round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_qdq(x, 32)

    def fp4_round_trip(self, x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
        return fp4_qdq(x, block, e4m3_scale)

    def rotate_(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable,
                inverse: bool = False) -> torch.Tensor:
        return rope.rotate_(x, positions, inverse)

    def hc_collapse(self, stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return collapse(stream, pre)

    def hc_expand(self, output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
        return expand(output, residual, post, comb)

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     seq: torch.Tensor) -> torch.Tensor:
        per_head = torch.bmm(q, keys[seq].transpose(1, 2))  # every query its own product, as the reference
        return (per_head.relu_() * weights.unsqueeze(-1)).sum(dim=1)

    def index_score_row_elements(self, heads: int, dim: int, entries: int) -> int:
        return entries * max(heads, dim)  # the query's copy of the keys [E, d], its per-head scores [H, E]

    def top_entries(self, scores: torch.Tensor, k_per_row: torch.Tensor, k_max: int) -> torch.Tensor:
        return top_entries(scores, k_per_row, k_max)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, fp8_ready: bool = False) -> torch.Tensor:
        gate, up = gate.float(), up.float()
        if limit > 0:
            up = torch.clamp(up, min=-limit, max=limit)
            gate = torch.clamp(gate, max=limit)
        return (F.silu(gate) * up).to(torch.bfloat16)

    def ngram_hash_ids(self, *args) -> torch.Tensor:
        return ngram_hash_ids(*args)

    def engram_gate(self, stream: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor,
                    eps: float, clamp_value: float) -> torch.Tensor:
        return engram_gate(stream, key, value, weight, eps, clamp_value)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, bias, rule)

    def moe_sum(self, routed: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        y = combine_routed(routed, ids)
        y += shared
        return y.to(shared.dtype)
