"""The RMSNorm kernel (``model/kernels/triton_rms_norm.py``) against its twin ``model.layers.rms_norm``.

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the GPU
on CUDA tensors; the twin runs on the CPU.

The kernel sums its squares in another order than torch and takes ``rsqrt`` from another library:
the fp32 results differ by a few ulps, so the bf16 outputs may differ by one bf16 ulp (at most
2**-7 of the value) in a few elements. The check: every element within one bf16 ulp of the twin's,
and at least 95% of them bit-equal (measured: 99-100%). A missing ``eps``, the weight skipped or
the mean taken over the wrong count fail it (``test_rms_norm_check_rejects_a_wrong_arithmetic``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.layers import rms_norm as rms_norm_twin  # noqa: E402
from tests.kernel_checks import device, one_bf16_ulp_mismatch  # noqa: E402


def rms_kernel(x, weight, eps):
    from model.kernels.triton_rms_norm import rms_norm

    return rms_norm(x.to(device()), weight.to(device()), eps).cpu()


def rms_mismatch(got, ref) -> str | None:
    return one_bf16_ulp_mismatch(got, ref, min_bit_equal=0.95)


def rms_inputs(rows: int, d: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=gen) * torch.rand(rows, 1, generator=gen) * 10).to(dtype)
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    return x, weight


@pytest.mark.parametrize("rows,d", [(1, 64), (7, 512), (64, 1024), (3, 5120), (300, 128)])
def test_rms_norm_matches_the_twin(rows, d):
    x, weight = rms_inputs(rows, d, seed=rows + d)
    assert (failure := rms_mismatch(rms_kernel(x, weight, 1e-6), rms_norm_twin(x, weight, 1e-6))) is None, failure


def test_rms_norm_fp32_rows_and_batch_independence():
    x, weight = rms_inputs(40, 256, seed=2, dtype=torch.float32)
    got = rms_kernel(x, weight, 1e-6)
    assert got.dtype == torch.float32
    assert ((got - rms_norm_twin(x, weight, 1e-6)).abs() <= rms_norm_twin(x, weight, 1e-6).abs() * 2.0 ** -20).all()
    for chosen in (slice(0, 1), slice(17, 18), slice(39, 40)):
        assert torch.equal(rms_kernel(x[chosen], weight, 1e-6), got[chosen])


def test_rms_norm_check_rejects_a_wrong_arithmetic():
    x, weight = rms_inputs(64, 512, seed=4)
    x[0] *= 1e-4  # a small row, where eps matters
    ref = rms_norm_twin(x, weight, 1e-2)
    xf = x.float()
    wrong = {
        "no eps": (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True)))).bfloat16(),
        "no weight": (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-2)).bfloat16(),
        "mean over D + 1": (weight * (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) / 513 + 1e-2))).bfloat16(),
    }
    for name, value in wrong.items():
        assert rms_mismatch(value, ref) is not None, name
