"""Engram's gated add (``model/kernels/triton_engram.py``) against its twin (``model.engram.engram_gate``).

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the GPU
on CUDA tensors; the twin runs on the CPU. The kernel does the twin's fp32 operations in its order
except for the order of the three row sums, and ``exp``/``rsqrt`` come from another library, so the
gate of a row may differ from the twin's by a few fp32 ulps, more where the dot product is near zero
(the square root magnifies it there): on the 4,096-token set below the twin's own fp32 gate is up to
7.2e-7 from its float64 value. An output ``h + gate * v`` then differs by up to ~2e-6 |v| before its
bf16 rounding, which is more than one bf16 ulp of the output where ``h`` and ``gate * v`` nearly
cancel (a one-ulp move of the gate alone fails a pure one-ulp check at 64 tokens, and at 4,096 tokens
on the GPU it did). Check: within one bf16 ulp of the output plus 2**-16 |v|, and at least 99%
bit-equal; a wrong gate formula is off by ~0.1 |v|. A row alone equals its row in a batch (the kernel
is row-local).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.engram import engram_gate as twin  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

EPS, CLAMP = 1e-6, 1e-6


def inputs(tokens: int, hc: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    stream = (torch.randn(tokens, hc, dim, generator=gen) * 3).bfloat16()
    kv = torch.randn(tokens, hc * dim + dim, generator=gen).bfloat16()  # key and value: column ranges of one tensor
    weight = torch.randn(hc, dim, generator=gen) * 0.2
    return stream, kv, weight


def mismatch(got: torch.Tensor, ref: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why ``got`` is not within the bound of the module docstring; None if it is."""
    got, ref = got.float(), ref.float()
    allowed = ref.abs() * 2.0 ** -7 + value.float().abs().unsqueeze(-2) * 2.0 ** -16
    if not bool(((got - ref).abs() <= allowed).all()):
        return f"beyond the bound by up to {((got - ref).abs() - allowed).max().item():.3g}"
    equal = (got == ref).float().mean().item()
    return None if equal >= 0.99 else f"only {equal:.2%} bit-equal"


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
    assert (problem := mismatch(got, ref, value)) is None, problem


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
    assert (problem := mismatch(got, ref, value)) is None, problem


def test_the_bound_tolerates_a_moved_gate_and_rejects_a_wrong_one():
    """The check itself: the twin's output with its gate moved by 1e-6 passes, with the gate's square
    root dropped (a plausible slip) fails."""
    stream, kv, weight = inputs(4096, 4, 64, seed=5)
    hc, dim = stream.shape[1:]
    key, value = kv.split([hc * dim, dim], dim=-1)
    ref = twin(stream, key, value, weight, EPS, CLAMP)
    h, k = stream.float(), key.float().unflatten(-1, (hc, dim))
    rstd = torch.rsqrt(h.square().mean(-1) + EPS) * torch.rsqrt(k.square().mean(-1) + EPS)
    dot = (h * weight * k).sum(-1) * rstd * dim ** -0.5
    moved = torch.sigmoid(torch.copysign(dot.abs().clamp_min(CLAMP).sqrt(), dot)) + 1e-6
    wrong = torch.sigmoid(dot)
    with_gate = lambda gate: (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).bfloat16()  # noqa: E731
    assert mismatch(with_gate(moved), ref, value) is None
    assert mismatch(with_gate(wrong), ref, value) is not None
