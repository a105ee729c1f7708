"""The FP4 round-trip kernel (``model/kernels/triton_fp4_round_trip.py``) against its twin ``model.quant.fp4_qdq``.

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the GPU
on CUDA tensors; the twin runs on the CPU.

The FP4 round trip is exact arithmetic (a group max, a scale read off the bits or rounded to E4M3,
an IEEE division, midpoint comparisons, an exact product): the kernel must equal the twin bit for
bit, on every value class (zeros of both signs, subnormal groups, exact midpoints, values that
saturate).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.quant import fp4_qdq  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


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


@pytest.mark.parametrize("shape, rope_dims, block, e4m3_scale", [
    ((3, 32, 128), 64, 32, False),  # V4.1-Flash's index queries: a token's 32 heads share its position
    ((5, 128), 64, 32, False),  # the compressor's index keys
    ((5, 512), 64, 16, True),  # the compressor's entries
    ((7, 4, 64), 16, 32, False), ((6, 64), 16, 16, True),  # the tiny models: rotated and plain dims share a group
])
def test_rope_in_the_round_trip_gives_the_two_launches_bits(shape, rope_dims, block, e4m3_scale):
    """``rotary_fp4_round_trip``: the Triton backend rotates the values as the round trip loads them, with
    ``_rope_kernel``'s arithmetic: the same bits as ``rotate_`` and the round trip apart."""
    from model.kernels.backend import KernelBackend
    from model.kernels.triton_backend import TritonKernels
    from model.rope import RotaryTable, rope_frequencies

    x = awkward_values(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], seed=sum(shape))
    x = x.view(shape).to(device())
    table = RotaryTable(rope_frequencies(rope_dims, 10000.0, 1.0, 0, 32, 1), 9000, device())
    positions = torch.randint(0, 9000, (shape[0],), generator=torch.Generator().manual_seed(1)).to(device())
    backend = TritonKernels()
    fused = backend.rotary_fp4_round_trip(x.clone(), positions, table, rope_dims, block, e4m3_scale)
    apart = KernelBackend.rotary_fp4_round_trip(backend, x.clone(), positions, table, rope_dims, block, e4m3_scale)
    assert torch.equal(fused, apart)
    assert not torch.equal(fused, backend.fp4_round_trip(x, block, e4m3_scale))  # the rotation taken
