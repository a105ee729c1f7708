"""FP8-ready rows (``model/kernels/backend.py``): the kernels that make a quantized linear's input round it
through FP8 themselves, and the linear skips its own launch for that.

Without a GPU these run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``). Every check
is bit for bit: a producer's round trip must equal ``fp8_qdq`` of its plain output, and a product of
FP8-ready rows must equal the product of the plain rows, at every size (the matrix-vector form, which
rounds inside the product and gets plain rows; the decode and prefill forms, which get the round trip).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.config import WeightFormat  # noqa: E402
from model.kernels import triton_decode_mm  # noqa: E402
from model.kernels.triton_backend import TritonKernels, matrix_vector_kernel  # noqa: E402
from model.quant import fp8_qdq  # noqa: E402
from tests.kernel_checks import device  # noqa: E402
from tests.test_triton_kernels import random_weight  # noqa: E402

EPS = 1e-6


def wide_rows(rows: int, cols: int, gen: torch.Generator, top: int = 2) -> torch.Tensor:
    """bf16 rows whose groups of 32 span many scales, up to ``10**top`` (e4m3 subnormals and the 1e-4 floor
    included)."""
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-7, top, cols // 32).repeat_interleave(32)
    return x.bfloat16().to(device())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_writes_the_round_trip_of_its_output(rows):
    from model.kernels.triton_rms_norm import BOTH, ROUND_TRIP, rms_norm

    gen = torch.Generator().manual_seed(rows)
    x = wide_rows(rows, 320, gen)  # 320 columns: a row block of 512, its last 192 columns masked
    weight = (torch.rand(320, generator=gen) + 0.5).bfloat16().to(device())
    plain = rms_norm(x, weight, EPS)
    rounded = rms_norm(x, weight, EPS, outputs=ROUND_TRIP)
    both = rms_norm(x, weight, EPS, outputs=BOTH)
    assert same_bits(rounded, fp8_qdq(plain.cpu(), 32))
    assert same_bits(both[0], plain) and same_bits(both[1], rounded)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm(x[:, :300], weight[:300], EPS, outputs=ROUND_TRIP)


def test_swiglu_writes_the_round_trip_of_its_output():
    from model.kernels.triton_moe_sum import swiglu

    gen = torch.Generator().manual_seed(2)
    gate, up = wide_rows(3, 1056, gen, top=1), wide_rows(3, 1056, gen, top=1)  # two blocks of 1024, the second mostly masked
    plain = swiglu(gate, up, 10.0)
    assert same_bits(swiglu(gate, up, 10.0, round_trip=True), fp8_qdq(plain.cpu(), 32))


# one split: the product rounds its output in its own epilogue (a tile of 64 or 128 rows: two or four groups of
# 32 features, a group's rows split between two tiles of 64); more: where its splits are added
@pytest.mark.parametrize("block_w,max_splits", [(64, 1), (128, 1), (64, 64)])
def test_decode_form_writes_the_round_trip_of_its_output(block_w, max_splits, monkeypatch):
    from model.kernels import tile_configs

    config = tile_configs.DecodeConfig(block_w, 64, 4, 3, programs_per_sm=64, max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_DECODE_MM_TABLE", ((64, config),))
    gen = torch.Generator().manual_seed(max_splits)
    weight = random_weight(WeightFormat.FP8, 3 * 128, 128, gen).to(device())
    x = wide_rows(12, 3 * 128, gen)
    plain = triton_decode_mm.decode_mm(x, weight.values, weight.scales, weight.fmt, groups=3)
    round_trips = []  # launches of their own
    real = triton_decode_mm.act_quant_bf16
    monkeypatch.setattr(triton_decode_mm, "act_quant_bf16",
                        lambda a, **options: round_trips.append(a.shape) or real(a, **options))
    rounded = triton_decode_mm.decode_mm(x, weight.values, weight.scales, weight.fmt, groups=3, round_trip=True)
    assert same_bits(rounded, fp8_qdq(plain.cpu(), 32))
    assert not round_trips


@pytest.mark.parametrize("m,batch_invariant", [(2, False), (5, False), (12, False), (12, True), (300, False)])
def test_fp8_ready_rows_give_every_product_the_same_bits(m, batch_invariant, monkeypatch):
    """What the model does with them: the attention's and the FFN's normed rows into a pair of projections,
    the SwiGLU into the down projection, the grouped ``wo_a`` into ``wo_b``. 2 tokens: ``triton_gemv`` (it
    rounds inside the product: the rows stay plain); 5 and 12: the decode form (12: the prefill form in the
    batch-invariant mode); 300: the prefill form. Where the rows are the round trip, no launch of the decode
    form rounds them again."""
    gen = torch.Generator().manual_seed(m)
    kernels = TritonKernels(batch_invariant=batch_invariant)
    x = wide_rows(m, 256, gen)
    norm = (torch.rand(256, generator=gen) + 0.5).bfloat16().to(device())
    pair = [random_weight(WeightFormat.FP8, n, 256, gen).to(device()) for n in (96, 160)]
    down = random_weight(WeightFormat.FP8, 64, 256, gen).to(device())
    wo_a = random_weight(WeightFormat.FP8, 2 * 64, 128, gen).to(device())
    wo_b = random_weight(WeightFormat.FP8, 96, 2 * 64, gen).to(device())

    plain, ready = kernels.rms_norm_and_fp8_ready(x, norm, EPS)
    assert same_bits(plain, kernels.rms_norm(x, norm, EPS))
    assert same_bits(ready, kernels.rms_norm(x, norm, EPS, fp8_ready=True))
    rounds_apart = batch_invariant or matrix_vector_kernel(m) is None
    assert same_bits(ready, fp8_qdq(plain.cpu(), 32) if rounds_apart else plain)

    round_trips = []  # the decode form's own round trips of its input
    real = triton_decode_mm.act_quant_bf16
    monkeypatch.setattr(triton_decode_mm, "act_quant_bf16",
                        lambda a, **options: round_trips.append(a.shape) or real(a, **options))

    def prepared(product):  # a product of FP8-ready rows: no round trip of its input where the rows are one
        before = len(round_trips)
        out = product()
        assert len(round_trips) == before
        return out

    together = prepared(lambda: kernels.quantized_linears(ready, pair, prepared=True))
    for got, want in zip(together, kernels.quantized_linears(plain, pair), strict=True):
        assert same_bits(got, want)
    assert same_bits(prepared(lambda: kernels.quantized_linear(ready, pair[0], prepared=True)),
                     kernels.quantized_linear(plain, pair[0]))

    gate, up = wide_rows(m, 256, gen, top=1), wide_rows(m, 256, gen, top=1)
    hidden = kernels.swiglu(gate, up, 10.0, fp8_ready=True)
    assert same_bits(prepared(lambda: kernels.quantized_linear(hidden, down, prepared=True)),
                     kernels.quantized_linear(kernels.swiglu(gate, up, 10.0), down))

    o = wide_rows(m, 2 * 128, gen).view(m, 2, 128)
    output = kernels.grouped_dequantized_linear(o, wo_a, fp8_ready=True).flatten(1)
    assert same_bits(prepared(lambda: kernels.quantized_linear(output, wo_b, prepared=True)),
                     kernels.quantized_linear(kernels.grouped_dequantized_linear(o, wo_a).flatten(1), wo_b))
    if rounds_apart and m <= 256 and not batch_invariant:  # the decode form: the products of plain rows rounded them
        assert len(round_trips) >= 4


def test_plain_linear_refuses_fp8_ready_rows():
    from model.layers import Linear

    linear = Linear(torch.randn(8, 32).bfloat16(), TritonKernels(), batch_invariant=False)
    assert not linear.quantized
    with pytest.raises(ValueError, match="quantized linears only"):
        linear(torch.randn(2, 32).bfloat16(), prepared=True)


def test_producers_leave_the_rows_plain_when_switched_off(monkeypatch):
    """``tile_configs.ROUND_TRIP_IN_PRODUCERS`` off (the benchmarks' comparison): FP8-ready rows are the plain
    rows at every size, and each product rounds its own input again."""
    from model.kernels import tile_configs

    monkeypatch.setattr(tile_configs, "ROUND_TRIP_IN_PRODUCERS", False)
    gen = torch.Generator().manual_seed(4)
    kernels = TritonKernels()
    x = wide_rows(12, 256, gen)
    norm = (torch.rand(256, generator=gen) + 0.5).bfloat16().to(device())
    plain, ready = kernels.rms_norm_and_fp8_ready(x, norm, EPS)
    assert same_bits(ready, plain)
    weight = random_weight(WeightFormat.FP8, 96, 256, gen).to(device())
    round_trips = []
    real = triton_decode_mm.act_quant_bf16
    monkeypatch.setattr(triton_decode_mm, "act_quant_bf16",
                        lambda a, **options: round_trips.append(a.shape) or real(a, **options))
    kernels.quantized_linear(ready, weight, prepared=True)
    assert round_trips == [(12, 256)]
