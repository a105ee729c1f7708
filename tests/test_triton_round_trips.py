"""The FP4 round-trip and RMSNorm kernels against their twins (``model.quant.fp4_qdq``, ``model.layers.rms_norm``).

Without a GPU they run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the
GPU on CUDA tensors; the twins run on the CPU.

* The FP4 round trip is exact arithmetic (a group max, a scale read off the bits or rounded to
  E4M3, an IEEE division, midpoint comparisons, an exact product): the kernel must equal the twin bit
  for bit, on every value class (zeros of both signs, subnormal groups, exact midpoints, values that
  saturate).
* RMSNorm sums its squares in another order than torch and takes ``rsqrt`` from another library:
  the fp32 results differ by a few ulps, so the bf16 outputs may differ by one bf16 ulp (at most 2**-7
  relative) in a few elements. The check: every element within one bf16 ulp of the twin's, and at
  least 95% of them bit-equal (measured: 99-100%). A missing ``eps``, the weight skipped or the
  mean taken over the wrong count fail it (``test_rms_norm_check_rejects_a_wrong_arithmetic``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.layers import rms_norm as rms_norm_twin  # noqa: E402
from model.quant import fp4_qdq  # noqa: E402
from tests.kernel_checks import device, one_bf16_ulp_mismatch  # noqa: E402


def fp4_kernel(x, block, e4m3_scale):
    from model.kernels.triton_fp4_round_trip import fp4_round_trip

    return fp4_round_trip(x.to(device()), block, e4m3_scale).cpu()


def awkward_values(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random bf16 rows over many magnitudes, with the value classes that catch rounding bugs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-20, 8, (rows, 1), generator=gen).float())
    x[0] = 0.0
    x[1, : k // 2] = -0.0
    x[2] = torch.randn(k, generator=gen) * 2.0 ** -130  # subnormal groups
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[3] = midpoints.repeat(k // 8) * torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)  # exact ties (scale 1)
    x[4] = torch.randn(k, generator=gen) * 1e30
    return x.bfloat16()


@pytest.mark.parametrize("block,e4m3_scale", [(32, False), (16, True)], ids=["ue8m0-32", "e4m3-16"])
@pytest.mark.parametrize("shape", [(5, 32), (33, 128), (7, 3, 128), (300, 512)], ids=str)
def test_fp4_round_trip_is_the_twin_bit_for_bit(shape, block, e4m3_scale):
    rows = 1
    for n in shape[:-1]:
        rows *= n
    x = awkward_values(max(rows, 5), shape[-1], seed=sum(shape))[:rows].reshape(shape) if rows >= 5 else \
        awkward_values(5, shape[-1], seed=1).reshape(shape)
    ref = fp4_qdq(x, block, e4m3_scale)
    got = fp4_kernel(x, block, e4m3_scale)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))  # bits: -0.0 is not 0.0


def test_fp4_round_trip_of_a_strided_view():
    x = awkward_values(9, 256, seed=3)[:, :128]
    assert torch.equal(fp4_kernel(x, 32, False).view(torch.int16), fp4_qdq(x, 32).view(torch.int16))


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
