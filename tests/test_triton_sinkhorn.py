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
MIXES = (2 + HC) * HC
RELATIVE = 2.0 ** -17


def random_inputs(t: int, seed: int, on: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    mixes = torch.randn(t, MIXES, generator=gen) * 3
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(MIXES, generator=gen)
    return mixes.to(on), scale.to(on), base.to(on)


def as_one_slice(mixes: torch.Tensor) -> torch.Tensor:
    """The kernel's input for raw ``mixes``: one slice whose sum of squares is 1 (with ``k = 1`` and
    ``norm_eps = 0`` the kernel's rsqrt is then exactly 1)."""
    from model.kernels.triton_hc_coefficients import PARTIAL_COLS

    partials = torch.zeros(mixes.shape[0], 1, PARTIAL_COLS, dtype=torch.float32, device=mixes.device)
    partials[:, 0, :MIXES] = mixes
    partials[:, 0, MIXES] = 1.0
    return partials


def kernel_on(mixes, scale, base):
    from model.kernels.triton_sinkhorn import split_sinkhorn

    return split_sinkhorn(as_one_slice(mixes), 1, 0.0, scale, base, HC, ITERS, EPS)


def kernel(mixes, scale, base):
    return tuple(x.cpu() for x in kernel_on(mixes.to(device()), scale.to(device()), base.to(device())))


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


def test_slices_add_up_and_the_rsqrt_applies():
    """Mixes 2m given as two slices of m, with a mean square of 4 (rsqrt 1/2): exactly m again, so the
    same bits as m in one slice."""
    from model.kernels.triton_sinkhorn import split_sinkhorn

    mixes, scale, base = random_inputs(9, seed=4)
    partials = torch.cat([as_one_slice(mixes)] * 2, dim=1)
    partials[:, :, MIXES] = 2.0 * 8  # the squares of k = 8 columns, over two slices: mean 4
    partials, scale_d, base_d = (x.to(device()) for x in (partials, scale, base))
    got = tuple(x.cpu() for x in split_sinkhorn(partials, 8, 0.0, scale_d, base_d, HC, ITERS, EPS))
    assert all(torch.equal(a, b) for a, b in zip(got, kernel(mixes, scale, base)))
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
    got = kernel_on(*inputs)
    assert (failure := too_far(got, twin(*inputs, HC, ITERS, EPS))) is None, failure
