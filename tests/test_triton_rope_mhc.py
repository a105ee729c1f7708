"""The RoPE and mHC-mix kernels against their twins (``RotaryTable.rotate_``, ``mhc.collapse``, ``mhc.expand``).

Without a GPU they run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the
GPU on CUDA tensors; the twins run on the CPU.

Each output is a short fp32 expression of exact bf16 inputs (a complex product; a sum of four
products) rounded once to bf16. The kernels round each product and add in a fixed order; torch may
contract a product into an FMA or add in another order, which moves the fp32 value by an ulp or
two and so, rarely, the bf16 result by one bf16 ulp (at most 2**-7 of the value). The check: every
element within one bf16 ulp, at least 99% bit-equal (measured: 99.9-100%); a wrong sign in the
rotation, a missing conjugate, a transposed ``comb`` or a dropped term fail it
(``test_the_check_rejects_a_wrong_arithmetic``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.mhc import collapse as collapse_twin  # noqa: E402
from model.mhc import expand as expand_twin  # noqa: E402
from model.rope import RotaryTable, rope_frequencies  # noqa: E402
from tests.kernel_checks import device, one_bf16_ulp_mismatch  # noqa: E402


def mismatch(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    return one_bf16_ulp_mismatch(got, ref, min_bit_equal=0.99)


def rotary_table(rope_dims: int) -> RotaryTable:
    return RotaryTable(rope_frequencies(rope_dims, 10000.0, 1.0, 0, 32, 1), 9000)


def rope_kernel(x, positions, table, inverse):
    from model.kernels.triton_rope import rotate_

    on = x.to(device())
    rotate_(on, positions.to(device()), table.to(device()), inverse)
    return on.cpu()


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (5, 3, 64), (33, 64, 64), (4, 17, 16)], ids=str)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_rope_matches_the_twin(shape, inverse):
    gen = torch.Generator().manual_seed(sum(shape))
    table = rotary_table(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 4).bfloat16()
    positions = torch.randint(0, 9000, (shape[0],), generator=gen)
    ref = table.rotate_(x.clone(), positions, inverse)
    assert (failure := mismatch(rope_kernel(x, positions, table.table, inverse), ref)) is None, failure


def test_rope_rotates_only_its_view_in_place():
    """The last 64 of 512 dims of every head, through a strided view; the rest is untouched."""
    gen = torch.Generator().manual_seed(1)
    table = rotary_table(64)
    x = torch.randn(6, 8, 512, generator=gen).bfloat16().to(device())
    positions = torch.randint(0, 9000, (6,), generator=gen)
    expected = x.cpu().clone()
    table.rotate_(expected[..., -64:], positions)
    from model.kernels.triton_rope import rotate_

    rotate_(x[..., -64:], positions.to(device()), table.table.to(device()))
    assert torch.equal(x[..., :-64].cpu(), expected[..., :-64])
    assert mismatch(x[..., -64:].cpu(), expected[..., -64:]) is None


def mix_inputs(t: int, hc: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    stream = (torch.randn(t, hc, d, generator=gen) * 3).bfloat16()
    output = torch.randn(t, d, generator=gen).bfloat16()
    pre = torch.rand(t, hc, generator=gen)
    post = 2 * torch.rand(t, hc, generator=gen)
    comb = torch.softmax(torch.randn(t, hc, hc, generator=gen), dim=-1)
    return stream, output, pre, post, comb


def mix_kernels(stream, output, pre, post, comb):
    from model.kernels.triton_mhc import collapse, expand

    on = [x.to(device()) for x in (stream, output, pre, post, comb)]
    return collapse(on[0], on[2]).cpu(), expand(on[1], on[0], on[3], on[4]).cpu()


@pytest.mark.parametrize("t,hc,d", [(1, 4, 256), (7, 4, 5120), (64, 4, 1000), (3, 2, 64)])
def test_collapse_and_expand_match_the_twins(t, hc, d):
    stream, output, pre, post, comb = mix_inputs(t, hc, d, seed=t + d)
    got_collapse, got_expand = mix_kernels(stream, output, pre, post, comb)
    assert (failure := mismatch(got_collapse, collapse_twin(stream, pre))) is None, failure
    assert (failure := mismatch(got_expand, expand_twin(output, stream, post, comb))) is None, failure


def test_mixes_do_not_depend_on_the_batch():
    inputs = mix_inputs(20, 4, 3000, seed=3)
    batched = mix_kernels(*inputs)
    for chosen in (slice(0, 1), slice(9, 12), slice(19, 20)):
        alone = mix_kernels(*(x[chosen] for x in inputs))
        assert torch.equal(alone[0], batched[0][chosen]) and torch.equal(alone[1], batched[1][chosen])


def test_the_check_rejects_a_wrong_arithmetic():
    gen = torch.Generator().manual_seed(5)
    table = rotary_table(64)
    x = (torch.randn(9, 4, 64, generator=gen) * 4).bfloat16()
    positions = torch.randint(1, 9000, (9,), generator=gen)
    ref = table.rotate_(x.clone(), positions)
    assert mismatch(table.rotate_(x.clone(), positions, inverse=True), ref) is not None, "conjugate"
    assert mismatch(table.rotate_(x.clone(), positions + 1), ref) is not None, "position"
    stream, output, pre, post, comb = mix_inputs(9, 4, 256, seed=6)
    ref = expand_twin(output, stream, post, comb)
    assert mismatch(expand_twin(output, stream, post, comb.transpose(1, 2)), ref) is not None, "comb transposed"
    assert mismatch(expand_twin(output * 0, stream, post, comb), ref) is not None, "output dropped"
    assert mismatch(collapse_twin(stream[:, :3], pre[:, :3]), collapse_twin(stream, pre)) is not None, "a copy dropped"
