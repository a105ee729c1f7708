"""Engram's gated add (``model/kernels/triton_engram.py``) against its twin (``model.engram.engram_gate``).

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the GPU
on CUDA tensors; the twin runs on the CPU. The kernel does the twin's fp32 operations in its order
except for the order of the three row sums, and ``exp``/``rsqrt`` come from another library, so the
gate may move by an fp32 ulp and an output, rarely, by one bf16 ulp. Check: within one bf16 ulp and
at least 99% bit-equal; a row alone equals its row in a batch (the kernel is row-local).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.engram import engram_gate as twin  # noqa: E402
from tests.kernel_checks import device, one_bf16_ulp_mismatch  # noqa: E402

EPS, CLAMP = 1e-6, 1e-6


def inputs(tokens: int, hc: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    stream = (torch.randn(tokens, hc, dim, generator=gen) * 3).bfloat16()
    kv = torch.randn(tokens, hc * dim + dim, generator=gen).bfloat16()  # key and value: column ranges of one tensor
    weight = torch.randn(hc, dim, generator=gen) * 0.2
    return stream, kv, weight


def run(stream, kv, weight, on):
    from model.kernels.triton_engram import engram_gate

    hc, dim = stream.shape[1:]
    stream, kv, weight = stream.to(on), kv.to(on), weight.to(on)
    key, value = kv.split([hc * dim, dim], dim=-1)
    return engram_gate(stream, key, value, weight, EPS, CLAMP).cpu()


@pytest.mark.parametrize("tokens,hc,dim", [(1, 4, 5120), (7, 4, 256), (3, 2, 1000), (2, 1, 64)])
def test_engram_gate_matches_the_twin(tokens, hc, dim):
    stream, kv, weight = inputs(tokens, hc, dim, seed=tokens * dim)
    key, value = kv.split([hc * dim, dim], dim=-1)
    ref = twin(stream, key, value, weight, EPS, CLAMP)
    got = run(stream, kv, weight, device())
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert (problem := one_bf16_ulp_mismatch(got, ref, min_bit_equal=0.99)) is None, problem


def test_engram_gate_follows_the_gate_sign_and_the_clamp():
    """A copy aligned with its key opens the gate (> 1/2), one opposed closes it (< 1/2), and a zero
    dot product is clamped to a gate of sigmoid(+-sqrt(clamp)), not 1/2 exactly: the twin's formula."""
    dim = 64
    h = torch.ones(1, 3, dim)
    h[0, 2] = 0
    stream = h.bfloat16()
    key = torch.cat([torch.ones(dim), -torch.ones(dim), torch.ones(dim)]).view(1, -1)
    value = torch.full((1, dim), 4.0)
    kv = torch.cat([key, value], dim=-1).bfloat16()
    weight = torch.ones(3, dim)
    got = run(stream, kv, weight, device())
    ref = twin(stream, *kv.split([3 * dim, dim], dim=-1), weight, EPS, CLAMP)
    assert torch.equal(got, ref)
    assert got[0, 0, 0] > 1 + 2 and got[0, 1, 0] < 1 + 2  # 1 + gate * 4 on either side of the half
    assert 0 < got[0, 2, 0] < 4


def test_engram_gate_rows_do_not_depend_on_the_batch():
    stream, kv, weight = inputs(9, 4, 384, seed=3)
    batched = run(stream, kv, weight, device())
    for row in (0, 4, 8):
        alone = run(stream[row:row + 1], kv[row:row + 1], weight, device())
        assert torch.equal(alone, batched[row:row + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_engram_gate_at_v41_width_on_the_gpu(tokens):
    stream, kv, weight = inputs(tokens, 4, 5120, seed=tokens)
    key, value = kv.split([4 * 5120, 5120], dim=-1)
    ref = twin(stream, key, value, weight, EPS, CLAMP)
    got = run(stream, kv, weight, "cuda")
    assert (problem := one_bf16_ulp_mismatch(got, ref, min_bit_equal=0.99)) is None, problem
