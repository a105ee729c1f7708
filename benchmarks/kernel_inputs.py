"""What ``benchmarks/kernels.py`` measures: the V4.1-Flash shapes of a layer's FP8 projections and
routed experts (and tiny ones for the interpreter), random weights in their storage formats made on
the device, random routings, and the plain torch baselines a reader would write (dequantize, then
multiply).

The model's modules are imported inside the functions: ``benchmarks/kernels.py`` decides first
whether Triton runs in its interpreter (``TRITON_INTERPRET``), which must be set before they load."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shapes:
    dim: int
    n_heads: int
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    index_heads: int
    index_dim: int
    experts: int
    top_k: int
    inter: int
    swiglu_limit: float = 10.0
    route_scale: float = 1.5


FLASH = Shapes(dim=5120, n_heads=64, head_dim=512, q_lora=1280, o_groups=8, o_lora=1024, index_heads=32,
               index_dim=128, experts=384, top_k=6, inter=2304)
# Every width a multiple of 64 (one GEMM K step) and every N a multiple of 32 (one FP8 scale tile).
TINY = Shapes(dim=256, n_heads=4, head_dim=64, q_lora=64, o_groups=2, o_lora=64, index_heads=4, index_dim=32,
              experts=8, top_k=2, inter=128)


@dataclass(frozen=True)
class LinearSpec:
    """One FP8 projection: weight ``[groups * n, k]``; grouped: ``x [M, groups, k] -> [M, groups, n]``."""

    name: str
    n: int
    k: int
    gain_key: str
    groups: int = 1

    @property
    def shape_text(self) -> str:
        g = f"{self.groups}x" if self.groups > 1 else ""
        return f"{g}[{self.n}, {self.k}]"


def linear_specs(s: Shapes) -> list[LinearSpec]:
    return [
        LinearSpec("attn.wq_a", s.q_lora, s.dim, "wq_a"),
        LinearSpec("attn.wq_b", s.n_heads * s.head_dim, s.q_lora, "wq_b"),
        LinearSpec("attn.wkv", s.head_dim, s.dim, "wkv"),
        LinearSpec("attn.wo_a (grouped)", s.o_lora, s.n_heads * s.head_dim // s.o_groups, "wo_a", s.o_groups),
        LinearSpec("attn.wo_b", s.dim, s.o_groups * s.o_lora, "wo_b"),
        LinearSpec("indexer.wq_b", s.index_heads * s.index_dim, s.q_lora, "wq_b"),
        LinearSpec("shared.w1", s.inter, s.dim, "w1"),
        LinearSpec("shared.w3", s.inter, s.dim, "w3"),
        LinearSpec("shared.w2", s.dim, s.inter, "w2"),
    ]


# projections of one input that the model runs as one call (``model.layers.project``: one launch where
# the kernel backend has one, as at one token); the layer's CUDA graph runs them the same way
LAYER_PAIRS = (("attn.wq_a", "attn.wkv"), ("attn.wq_b", "indexer.wq_b"), ("shared.w1", "shared.w3"))


def layer_calls(specs: list[LinearSpec], weight_of, kernels, m: int, gen: torch.Generator, device: torch.device,
                fp8_ready: bool = True):
    """One layer's FP8 projections as the model calls them, on fresh random inputs of ``m`` tokens:
    ``[(names, x, call)]``, each ``call()`` returning the outputs of ``names`` for input ``x``; the pairs of
    ``LAYER_PAIRS`` through ``kernels.quantized_linears``, every other projection (and a pair member
    whose partner is not in ``specs``) alone. ``weight_of(name)``: the weight to use for it.

    ``fp8_ready``: as in the model, the quantized linears' inputs are FP8-ready rows (``model/kernels/
    backend.py``; here their FP8 round trip, which is FP8-ready for any backend at any size) and the grouped
    ``wo_a`` makes its output FP8-ready for ``wo_b``; off: plain rows, each product rounding its own."""
    by_name = {spec.name: spec for spec in specs}
    partner = {a: b for a, b in LAYER_PAIRS if a in by_name and b in by_name}
    calls = []
    for spec in specs:
        if spec.name in partner.values():
            continue  # called with its pair
        shape = (m, spec.groups, spec.k) if spec.groups > 1 else (m, spec.k)
        x = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
        if fp8_ready and spec.groups == 1:
            x = kernels.fp8_round_trip(x)
        w = weight_of(spec.name)
        if spec.name in partner:
            ws = [w, weight_of(partner[spec.name])]
            calls.append(((spec.name, partner[spec.name]), x,
                          lambda x=x, ws=ws: kernels.quantized_linears(x, ws, prepared=fp8_ready)))
        elif spec.groups > 1:
            calls.append(((spec.name,), x,
                          lambda x=x, w=w: [kernels.grouped_dequantized_linear(x, w, fp8_ready=fp8_ready)]))
        else:
            calls.append(((spec.name,), x, lambda x=x, w=w: [kernels.quantized_linear(x, w, prepared=fp8_ready)]))
    return calls


# ----------------------------------------------------------------------------------- data
def fp8_weight(rows: int, cols: int, gain: float, device: torch.device, gen: torch.Generator):
    """An FP8 projection as a checkpoint holds it: normal * gain * fan_in**-0.5, quantized per 32x32 tile."""
    from model.checkpoint_maker import quantize_fp8
    from model.config import WeightFormat
    from model.kernels.weights import QuantizedWeight

    w = torch.randn(rows, cols, device=device, generator=gen).mul_(gain * cols ** -0.5)
    try:
        values, scales = quantize_fp8(w)
    except (RuntimeError, NotImplementedError):  # a build without fp32 -> e8m0 casts on this device
        values, scales = quantize_fp8_bits(w)
    return QuantizedWeight(values, scales, WeightFormat.FP8)


def quantize_fp8_bits(w: torch.Tensor):
    """``quantize_fp8`` (rows and columns multiples of 32) with the UE8M0 scale built from its bits."""
    rows, cols = w.shape
    tiles = w.float().view(rows // 32, 32, cols // 32, 32)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(448.0 * 2.0 ** -126)
    bits = (amax / 448.0).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil(log2) + 127
    scale = (exponent << 23).view(torch.float32)
    values = (tiles / scale[:, None, :, None]).clamp_(-448.0, 448.0).view(rows, cols).to(torch.float8_e4m3fn)
    return values, exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def fp4_stack(experts: int, rows: int, cols: int, gain: float, device: torch.device, gen: torch.Generator):
    """Stacked FP4 experts ``[E, rows, cols]``: uniform random packed e2m1 bytes, UE8M0 scales around
    gain * fan_in**-0.5 / FP4_SCALE_DIVISOR (one power of two either side), made on the device."""
    from model.checkpoint_maker import FP4_SCALE_DIVISOR
    from model.config import WeightFormat
    from model.kernels.weights import QuantizedWeight

    values = torch.empty(experts, rows, cols // 2, dtype=torch.int8, device=device)
    exponents = torch.empty(experts, rows, cols // 32, dtype=torch.uint8, device=device)
    base = 127 + round(math.log2(gain * cols ** -0.5 / FP4_SCALE_DIVISOR))
    slab = 32  # experts per draw: every random tensor stays far below 2**31 elements
    for e in range(0, experts, slab):
        values[e:e + slab].random_(-128, 128, generator=gen)
        exponents[e:e + slab].random_(base - 1, base + 2, generator=gen)
    return QuantizedWeight(values, exponents.view(torch.float8_e8m0fnu), WeightFormat.FP4)


def weight_copies(spec: LinearSpec, rotate_bytes: int, max_copies: int, device, gen) -> list:
    """Distinct random copies of a projection, enough that rotating through them keeps it out of L2."""
    from model.checkpoint_maker import GAINS

    gain = GAINS.get(spec.gain_key, 1.0)
    first = fp8_weight(spec.groups * spec.n, spec.k, gain, device, gen)
    count = max(1, min(max_copies, math.ceil(rotate_bytes / first.nbytes)))
    return [first] + [fp8_weight(spec.groups * spec.n, spec.k, gain, device, gen) for _ in range(count - 1)]


def random_routing(m: int, s: Shapes, device, gen):
    """Per token ``top_k`` distinct uniformly random experts; weights normalised and scaled as the router does."""
    scores = torch.rand(m, s.experts, device=device, generator=gen)
    weights, experts = scores.topk(s.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True) * s.route_scale
    pair_token = torch.arange(m * s.top_k, device=device) // s.top_k
    return pair_token, experts.reshape(-1), weights.reshape(-1).float().contiguous()


# ----------------------------------------------------------------------------------- plain torch
def torch_linear(x, w):
    return F.linear(x, w.dequantized())


def torch_grouped(x, w):
    t, g, k = x.shape
    return torch.einsum("tgk,grk->tgr", x, w.dequantized().view(g, -1, k))


def torch_moe(x, pair_token, pair_expert, pair_weight, experts, limit: float):
    """A loop over the experts the routing hits: dequantize each one's weights, SwiGLU, down projection."""
    out = torch.zeros(pair_token.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.bincount(pair_expert, minlength=experts.num_experts).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        xe = x[pair_token[pairs]]
        gate = F.linear(xe, experts.w1[e].dequantized()).float().clamp(max=limit)
        up = F.linear(xe, experts.w3[e].dequantized()).float().clamp(-limit, limit)
        hidden = (pair_weight[pairs, None] * F.silu(gate) * up).to(x.dtype)
        out[pairs] = F.linear(hidden, experts.w2[e].dequantized())
    return out
