"""Triton kernel of the router's rule for ``sqrtsoftplus`` scores (twin: ``model.routing.route``).

``route(logits, bias, rule)``: fp32 ``logits [N, E]`` -> (fp32 weights ``[N, k]``, int64 expert ids
``[N, k]``), one program per token holding its E logits: ``s = logits / temperature``; ``score =
sqrt(softplus(s))`` with torch's softplus (``s`` itself above 20, else ``log1p(exp(s))``) and IEEE
division and square root; the k experts of highest ``score + bias`` in descending order, picked one
at a time (the largest, the lowest id among equal ones); their scores, normalized by their sum plus
1e-20 (added in pick order) when ``norm_topk_prob``, times ``route_scale``. Torch takes ~11 kernels
for this per MoE layer (the division, softplus, sqrt, the bias, topk's two, the gather, the sum, the
normalization); a decode step runs it once per layer.

Differences from the twin: ``exp`` and ``log1p`` are CUDA's (the twin's run on the CPU, another
library), which moves a score by an ulp now and then, and the k weights are summed in pick order;
so weights agree within a few fp32 ulps, and the experts are the same but where two biased scores
are that close (``tests/test_triton_route.py``). Under the interpreter ``log1p`` is computed from
``log`` by Kahan's correction (no libdevice there). The other score functions stay with the twin.

Every token is routed alone: nothing depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..routing import RoutingRule
from .triton_common import INTERPRETED, exp_f32

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's default: above it softplus(s) is s


@triton.jit
def _log1p(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # Kahan: log(u) * x / (u - 1) with u = 1 + x is within a few ulps of log1p(x)
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * tl.div_rn(x, u - 1.0))
    else:
        return libdevice.log1p(x)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_l, stride_w, stride_i, temperature,
                  route_scale, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                  NORMALIZE: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    mask = experts < E
    s = tl.div_rn(tl.load(logits_ptr + row * stride_l + experts, mask=mask, other=0.0), temperature)
    softplus = tl.where(s > SOFTPLUS_THRESHOLD, s, _log1p(exp_f32(s, INTERPRETED), INTERPRETED))
    score = tl.sqrt_rn(softplus)
    biased = tl.where(mask, score + tl.load(bias_ptr + experts, mask=mask, other=0.0), -float("inf"))
    picks = tl.arange(0, K_POW2)
    picked_ids = tl.zeros((K_POW2,), dtype=tl.int32)
    picked = tl.zeros((K_POW2,), dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(biased, axis=0)
        chosen = tl.min(tl.where(biased == best, experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == chosen, score, 0.0), axis=0)  # adds zeros only: exact
        picked_ids = tl.where(picks == j, chosen, picked_ids)
        picked = tl.where(picks == j, weight, picked)
        total += weight
        biased = tl.where(experts == chosen, -float("inf"), biased)
    if NORMALIZE:
        picked = tl.div_rn(picked, total + 1e-20)
    picked = picked * route_scale
    tl.store(weights_ptr + row * stride_w + picks, picked, mask=picks < K)
    tl.store(ids_ptr + row * stride_i + picks, picked_ids.to(tl.int64), mask=picks < K)


def fuses(rule: RoutingRule) -> bool:
    """Whether this kernel computes ``rule`` (the others go to the twin)."""
    return rule.score_func == "sqrtsoftplus"


def route(logits: torch.Tensor, bias: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``logits [N, E]``, ``bias [E]`` -> (weights ``[N, k]`` fp32, ids ``[N, k]`` int64) (module docstring)."""
    if not fuses(rule):
        raise ValueError(f"the routing kernel computes sqrtsoftplus scores, not {rule.score_func}")
    n, e = logits.shape
    k = rule.top_k
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        bias = bias.float().contiguous()
        _route_kernel[(n,)](
            logits, bias, weights, ids, e, logits.stride(0), weights.stride(0), ids.stride(0),
            float(rule.temperature), float(rule.route_scale), K=k, K_POW2=max(2, triton.next_power_of_2(k)),
            BLOCK_E=max(16, triton.next_power_of_2(e)), NORMALIZE=rule.norm_topk_prob and k > 1,
            INTERPRETED=INTERPRETED, num_warps=4, enable_fp_fusion=False)
    return weights, ids
