"""mHC's Sinkhorn kernel (``model/kernels/triton_sinkhorn.py``) against its twin ``model.mhc.split_sinkhorn``.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``),
on the GPU on CUDA tensors; the twin runs on the CPU (and on CUDA in the GPU test).

Tolerance. Both sides do the same fp32 operations in the same order except for two things: the
sums over four values may associate differently, and ``exp`` comes from another library (CUDA's
``expf`` or numpy's against torch's CPU exp), each a difference of about one ulp. A Sinkhorn
normalisation divides by a sum of positive terms, so a relative error in its inputs reaches its
outputs at most doubled, and the iterations converge to a fixed point that damps what earlier
steps left. Measured in the interpreter at these shapes: at most 8 ulps apart (relative). The
check allows 64 ulps, ``2**-17`` relative; an omitted softmax eps or one iteration fewer moves
values by thousands of ulps and fails it (``test_the_check_rejects_a_wrong_arithmetic``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.mhc import split_sinkhorn as twin  # noqa: E402
from tests.kernel_checks import coefficients_too_far, device  # noqa: E402

HC, ITERS, EPS = 4, 20, 1e-6
RELATIVE = 2.0 ** -17


def random_inputs(t: int, seed: int, on: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    mixes = torch.randn(t, (2 + HC) * HC, generator=gen) * 3
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn((2 + HC) * HC, generator=gen)
    return mixes.to(on), scale.to(on), base.to(on)


def kernel(mixes, scale, base):
    from model.kernels.triton_sinkhorn import split_sinkhorn

    out = split_sinkhorn(mixes.to(device()), scale.to(device()), base.to(device()), HC, ITERS, EPS)
    return tuple(x.cpu() for x in out)


def too_far(got, ref) -> str | None:
    return coefficients_too_far(got, ref, RELATIVE)


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_matches_the_twin(t):
    inputs = random_inputs(t, seed=t)
    assert (failure := too_far(kernel(*inputs), twin(*inputs, HC, ITERS, EPS))) is None, failure


def test_rows_do_not_depend_on_the_batch():
    inputs = random_inputs(150, seed=3)
    batched = kernel(*inputs)
    for chosen in (slice(0, 1), slice(63, 65), slice(149, 150)):
        alone = kernel(inputs[0][chosen], *inputs[1:])
        assert all(torch.equal(a, b[chosen]) for a, b in zip(alone, batched)), chosen


def test_strided_mixes_and_empty_batch():
    mixes, scale, base = random_inputs(9, seed=4)
    wide = torch.cat([mixes, torch.randn(9, 5)], dim=1)[:, :mixes.shape[1]]  # rows not contiguous
    assert all(torch.equal(a, b) for a, b in zip(kernel(wide, scale, base), kernel(mixes, scale, base)))
    assert [x.shape for x in kernel(mixes[:0], scale, base)] == [(0, HC), (0, HC), (0, HC, HC)]


def _mutated_twin(mixes, scale, base, bug: str):
    """The twin with one deliberate bug."""
    pre, post, _ = twin(mixes, scale, base, HC, ITERS, EPS)
    comb = (mixes[..., 2 * HC:] * scale[2] + base[2 * HC:]).unflatten(-1, (HC, HC))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + (0.0 if bug == "no softmax eps" else EPS)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1 - (bug == "one iteration fewer")):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    return pre, post, comb


def test_the_check_rejects_a_wrong_arithmetic():
    inputs = random_inputs(300, seed=5)
    ref = twin(*inputs, HC, ITERS, EPS)
    for bug in ("no softmax eps", "one iteration fewer"):
        assert too_far(_mutated_twin(*inputs, bug), ref) is not None, bug


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_matches_the_twin_on_cuda(t):
    """Both on the GPU: the same ``expf`` and IEEE divisions, so only the order of the sums differs."""
    inputs = random_inputs(t, seed=t, on="cuda")
    from model.kernels.triton_sinkhorn import split_sinkhorn

    got = split_sinkhorn(*inputs, HC, ITERS, EPS)
    assert (failure := too_far(got, twin(*inputs, HC, ITERS, EPS))) is None, failure
