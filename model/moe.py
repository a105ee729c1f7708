"""The V4.1 mixture of experts: a sqrt-softplus router, top-k routed SwiGLU experts, one shared expert.

The router's correction bias only *selects* experts; the routing weights are the unbiased scores of
the selected experts, renormalised and scaled. The routing weight multiplies the expert's hidden
activation before its down projection (not the output). SwiGLU is clamped: the up branch on both
sides, the gate branch from above. Each token's output is summed in fp32 over its experts in
increasing expert id, then the shared expert's output is added, as the reference does.

With expert parallelism each rank holds some copies ("slots") of the routed experts; an expert map
(``workers/expert_load.py``) turns each (token, logical expert) pair into one slot and counts the
load, the dispatcher (``workers/expert_parallel.py``) moves token rows to the ranks holding their
slots and the per-(token, slot) outputs back, and the final sum runs over the *logical* ids, so it
happens in the same order whatever the number of ranks and the placement of the experts. The shared
expert runs while the dispatch is in flight (its exchange runs on the communicator's stream on
NCCL, on a background thread on gloo); its output is still added last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import device_ranges
from .kernels import ExpertWeights, KernelBackend
from .layers import Linear, project, quantized
from .routing import RoutingRule


@dataclass
class SharedExpert:
    """The always-on expert: a clamped SwiGLU over dense (FP8) projections, no routing weight."""

    w1: Linear  # gate projection
    w2: Linear  # down projection
    w3: Linear  # up projection
    swiglu_limit: float

    def to(self, device) -> "SharedExpert":
        for lin in (self.w1, self.w2, self.w3):
            lin.to(device)
        return self

    def __call__(self, x: torch.Tensor, x_fp8: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: the normed rows; ``x_fp8``: the same as FP8-ready rows (``model/kernels/backend.py``), which
        ``w1`` and ``w3`` take when both are quantized, or None."""
        kernels = self.w2.kernels  # the layer's backend (every Linear holds it)
        fp8_input = x_fp8 is not None and quantized(self.w1, self.w3)
        gate, up = project(x_fp8 if fp8_input else x, self.w1, self.w3, prepared=fp8_input)
        hidden = kernels.swiglu(gate, up, self.swiglu_limit, fp8_ready=self.w2.quantized)  # for w2 alone
        return self.w2(hidden, prepared=self.w2.quantized)


@dataclass
class Router:
    weight: torch.Tensor  # [experts, D] bf16 (as stored)
    bias: torch.Tensor  # [experts] fp32
    top_k: int
    score_func: str
    norm_topk_prob: bool
    route_scale: float
    temperature: float
    kernels: KernelBackend
    rule: RoutingRule = field(init=False)

    def __post_init__(self):
        self.rule = RoutingRule(self.top_k, self.score_func, self.norm_topk_prob, self.route_scale, self.temperature)

    def to(self, device) -> "Router":
        self.weight, self.bias = self.weight.to(device), self.bias.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k]) in descending biased-score order."""
        logits = self.kernels.fp32_linear(x, self.weight)  # fp32, as the reference
        return self.kernels.route(logits, self.bias, self.rule)


class MoE:
    def __init__(self, router: Router, experts: ExpertWeights, shared: SharedExpert, num_experts: int,
                 kernels: KernelBackend):
        self.router, self.experts, self.shared, self.num_experts = router, experts, shared, num_experts
        self.kernels = kernels
        # set by an expert-parallel runtime (workers/expert_parallel.py): exchanges token rows with
        # the ranks holding their experts (``dispatch``), runs ``expert_rows`` there and brings the
        # outputs back (``combine``)
        self.dispatcher = None
        # set by the expert load balancer (workers/expert_balancer.py): routes each (token, logical
        # expert) pair to a slot and counts the load (``route``). Without it, slot ids are the
        # logical ids (every expert once, in order)
        self.expert_map = None

    def to(self, device) -> "MoE":
        self.router.to(device)
        self.shared.to(device)
        self.experts.to(device)
        return self

    def local_expert_outputs(self, x: torch.Tensor, pair_token: torch.Tensor, pair_expert: torch.Tensor,
                             pair_weight: torch.Tensor) -> torch.Tensor:
        """Outputs ``[P, D]`` of (token, slot) pairs whose slots this rank holds (global slot ids);
        rows of other ranks' pairs stay zero."""
        first = self.experts.first_expert
        local = pair_expert - first if first else pair_expert  # no subtraction (a launch) when the slots start at 0
        return self.kernels.expert_outputs(x, pair_token, local, pair_weight.float(), self.experts)

    def expert_rows(self, rows: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``[R, k, D]``: for token rows ``[R, D]`` with their slot ids and routing weights
        ``[R, k]``, each pair's expert output; zero where the slot is not this rank's (or is -1)."""
        r, k = ids.shape
        pair_token = device_ranges.pair_tokens(r, k, rows.device)
        outputs = self.local_expert_outputs(rows, pair_token, ids.reshape(-1), gates.reshape(-1))
        return outputs.view(r, k, rows.shape[-1])

    def __call__(self, x: torch.Tensor, x_fp8: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: the normed rows; ``x_fp8``: the same as FP8-ready rows for the shared expert, or None."""
        # the shared expert beside the router and the routed experts (model/kernels/side_stream.py); under
        # expert parallelism it overlaps the exchange in flight instead
        beside = self.kernels.beside(x, lambda: self.shared(x, x_fp8)) if self.dispatcher is None else None
        weights, indices = self.router(x)
        slots = indices if self.expert_map is None else self.expert_map.route(indices)
        if beside is not None:
            routed = self.expert_rows(x, slots, weights)
            shared = beside.result()
        else:
            exchange = self.dispatcher.dispatch(x, weights, slots)
            shared = self.shared(x, x_fp8)
            routed = self.dispatcher.combine(exchange, self.expert_rows)
        # in logical id order, whatever the placement, then the shared expert's output
        return self.kernels.moe_sum(routed, indices, shared)


def combine_routed(routed: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Sum each token's expert outputs in fp32, in increasing expert id (the reference's order)."""
    order = torch.argsort(indices, dim=-1)
    ordered = torch.gather(routed, 1, order.unsqueeze(-1).expand_as(routed))
    y = torch.zeros(routed.shape[0], routed.shape[-1], dtype=torch.float32, device=routed.device)
    for slot in range(ordered.shape[1]):
        y += ordered[:, slot]
    return y
