"""``triton_split_sums.sum_partials`` adds the splits' fp32 partials one by one in split order (the bits
of a sequential fp32 sum, which the split products promise: the same bits whichever program adds),
whatever the number of splits against its four loads per loop step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from model.kernels.triton_split_sums import sum_partials  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

WIDTH = 64


@triton.jit
def _sum_kernel(part_ptr, out_ptr, splits, n, WIDTH: tl.constexpr):
    columns = tl.arange(0, WIDTH)
    mask = columns < n
    tl.store(out_ptr + columns, sum_partials(part_ptr + columns, splits, n, mask), mask=mask)


def _sequential(partials: torch.Tensor) -> np.ndarray:
    total = partials[0].numpy().copy()
    for part in partials[1:]:
        total = (total + part.numpy()).astype(np.float32)  # one fp32 rounding per split, in order
    return total


@pytest.mark.parametrize("splits", [1, 2, 4, 5, 7, 12, 33])
def test_partials_are_added_one_by_one_in_split_order(splits):
    gen = torch.Generator().manual_seed(splits)
    n = WIDTH - 3  # masked columns too
    # magnitudes spread over 2**-20 .. 2**20: the order of the additions shows in the bits
    partials = torch.randn(splits, n, generator=gen) * torch.exp2(torch.randint(-20, 21, (splits, n), generator=gen))
    partials[:, 0] = -0.0  # every split -0.0: the sum stays -0.0 (no split past the last added as +0.0)
    out = torch.empty(n, device=device())
    _sum_kernel[(1,)](partials.to(device()), out, splits, n, WIDTH=WIDTH)
    expected = _sequential(partials)
    assert np.array_equal(out.cpu().numpy().view(np.int32), expected.view(np.int32))
    assert torch.signbit(out[0]).item()
