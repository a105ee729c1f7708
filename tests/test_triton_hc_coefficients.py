"""mHC's coefficient kernels (``model/kernels/triton_hc_coefficients.py``) against their twin, the
reference's ``model.mhc.mixes`` followed by ``model.mhc.split_sinkhorn``.

Without a GPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``),
on the GPU on CUDA tensors; the twin runs on the CPU.

Tolerances. The raw mixes are fp32 sums of ``hc * D`` products in another order than torch's, so
they are checked against a float64 sum, within ``2**-20`` of the sum of the products' magnitudes
(fp32 summation of n terms errs by at most ~``n * 2**-24`` of that, much less in practice; the
measured error is ~``2**-25``, torch's own ~``2**-24``). The coefficients are checked against the
twin's split of the correctly rounded mixes (float64 products, rounded once), not of the twin's own
fp32 mixes: a sigmoid or a softmax turns a logit's absolute error into a relative error of the
output, so even tiny outputs carry it, and at V4.1-Flash's width (20,480 products per mix) the twin's
fp32 mixes themselves move the coefficients by up to ``2**-16`` relative at 4,096 tokens (measured
on the CPU). The check allows ``2**-14``; at the tests' small width the kernel measured at most ~15
fp32 ulps (``2**-19``) from it in the interpreter. A missing rsqrt, a mean over one copy instead of all of
them or a dropped slice of the stream fail it (``test_the_check_rejects_a_wrong_arithmetic``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.mhc import mixes as twin_mixes  # noqa: E402
from model.mhc import split_sinkhorn  # noqa: E402
from tests.kernel_checks import coefficients_too_far, device  # noqa: E402

HC, D, ITERS, HC_EPS, NORM_EPS = 4, 256, 20, 1e-6, 1e-6
MIXES = (2 + HC) * HC
RELATIVE = 2.0 ** -14


def random_inputs(t: int, seed: int, d: int = D):
    gen = torch.Generator().manual_seed(seed)
    stream = (torch.randn(t, HC, d, generator=gen) * 2).bfloat16()
    fn = torch.randn(MIXES, HC * d, generator=gen) * 0.05
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(MIXES, generator=gen)
    return stream, fn, scale, base


def kernel(stream, fn, scale, base):
    from model.kernels.triton_hc_coefficients import hc_coefficients

    on = (x.to(device()) for x in (stream, fn, scale, base))
    return tuple(x.cpu() for x in hc_coefficients(*on, HC, ITERS, HC_EPS, NORM_EPS))


def twin(stream, fn, scale, base):
    """The twin's split of the correctly rounded mixes (module docstring)."""
    x = stream.flatten(1).double()
    mixes = (x @ fn.double().T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)
    return split_sinkhorn(mixes.float(), scale, base, HC, ITERS, HC_EPS)


def too_far(got, ref) -> str | None:
    return coefficients_too_far(got, ref, RELATIVE)


@pytest.fixture(scope="module")
def batch_of_300():
    inputs = random_inputs(300, seed=3)
    return inputs, kernel(*inputs)


@pytest.mark.parametrize("t", [1, 7])
def test_matches_the_twin(t):
    inputs = random_inputs(t, seed=t)
    assert (failure := too_far(kernel(*inputs), twin(*inputs))) is None, failure


def test_matches_the_twin_in_a_prefill_sized_batch(batch_of_300):
    inputs, got = batch_of_300  # above 256 tokens: 64 tokens per program
    assert (failure := too_far(got, twin(*inputs))) is None, failure


def test_rows_do_not_depend_on_the_batch(batch_of_300):
    inputs, batched = batch_of_300
    for chosen in (slice(0, 1), slice(63, 66), slice(299, 300)):
        alone = kernel(inputs[0][chosen], *inputs[1:])
        assert all(torch.equal(a, b[chosen]) for a, b in zip(alone, batched)), chosen


def test_partial_sums_add_up_to_the_mixes():
    """The slices' partials summed are the float64 mixes (before the rsqrt) and sum of squares,
    including a stream width that is not a whole number of slices or steps."""
    from model.kernels.triton_hc_coefficients import PARTIAL_COLS, mix_partials

    for d in (D, 200):
        stream, fn, _, _ = random_inputs(5, seed=d, d=d)
        partials = mix_partials(stream.to(device()), fn.to(device())).cpu().double()
        assert partials.shape[2] == PARTIAL_COLS
        x = stream.flatten(1).double()
        exact, magnitude = x @ fn.double().T, x.abs() @ fn.double().abs().T
        assert ((partials[:, :, :MIXES].sum(1) - exact).abs() <= magnitude * 2.0 ** -20).all()
        squares = x.square().sum(1)
        assert ((partials[:, :, MIXES].sum(1) - squares).abs() <= squares * 2.0 ** -20).all()


def test_empty_batch():
    stream, fn, scale, base = random_inputs(0, seed=1)
    assert [x.shape for x in kernel(stream, fn, scale, base)] == [(0, HC), (0, HC), (0, HC, HC)]


def test_the_twins_own_fp32_mixes_pass_the_check_at_v41_flash_width():
    """A faithful fp32 computation (torch's, in its own order) passes where the kernel must."""
    stream, fn, scale, base = random_inputs(2048, seed=11, d=5120)
    own = split_sinkhorn(twin_mixes(stream, fn, NORM_EPS, False), scale, base, HC, ITERS, HC_EPS)
    assert (failure := too_far(own, twin(stream, fn, scale, base))) is None, failure


def test_the_check_rejects_a_wrong_arithmetic():
    stream, fn, scale, base = random_inputs(16, seed=5)
    ref = twin(stream, fn, scale, base)
    wrong = {
        "no rsqrt": split_sinkhorn(stream.flatten(1).float() @ fn.T, scale, base, HC, ITERS, HC_EPS),
        "mean over one copy": split_sinkhorn(
            (stream.flatten(1).float() @ fn.T) * torch.rsqrt(stream[:, 0].float().square().mean(-1, keepdim=True)
                                                            + NORM_EPS), scale, base, HC, ITERS, HC_EPS),
        "a slice dropped": twin(torch.cat([stream[..., :-32], torch.zeros_like(stream[..., -32:])], -1),
                                fn, scale, base),
    }
    for bug, got in wrong.items():
        assert too_far(got, ref) is not None, bug


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_matches_the_twin_on_cuda_at_v41_flash_width(t):
    """The real width (``hc * D = 20,480``: 40 slices), both sides on the GPU."""
    stream, fn, scale, base = (x.cuda() for x in random_inputs(t, seed=t, d=5120))
    from model.kernels.triton_hc_coefficients import hc_coefficients

    got = hc_coefficients(stream, fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    assert (failure := too_far(got, twin(stream, fn, scale, base))) is None, failure
    alone = hc_coefficients(stream[:1], fn, scale, base, HC, ITERS, HC_EPS, NORM_EPS)
    assert all(torch.equal(a, b[:1]) for a, b in zip(alone, got))
