"""The router's rule: from a token's expert logits to its k experts and their routing weights.

``route(logits, bias, rule)`` is the reference arithmetic (twin of ``kernels/triton_route.py``),
in fp32 as DeepSeek's reference computes it: the logits (``x @ gate.T``) divided by the
temperature, turned into scores (``sqrtsoftplus``: ``sqrt(softplus(s))``; ``sigmoid``;
``softmax``), the k experts of highest *biased* score (score + the load-balancing bias), each
weighted by its *unbiased* score, normalized over the k when ``norm_topk_prob`` (plus 1e-20, not
the norm eps: as in training) and times ``route_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class RoutingRule:
    top_k: int
    score_func: str  # one of SCORE_FUNCS
    norm_topk_prob: bool
    route_scale: float
    temperature: float


def route(logits: torch.Tensor, bias: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``logits [N, E]`` and ``bias [E]`` -> (weights ``[N, k]`` fp32, expert ids ``[N, k]``) in
    descending biased-score order."""
    scores = logits / rule.temperature
    if rule.score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif rule.score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = F.softplus(scores).sqrt()
    indices = (scores + bias).topk(rule.top_k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if rule.norm_topk_prob and rule.top_k > 1:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    weights *= rule.route_scale
    return weights, indices
