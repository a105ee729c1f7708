"""The MoE's elementwise kernels (``model/kernels/triton_moe_sum.py``) against their twins
(``ReferenceKernels.swiglu`` and ``.moe_sum``).

Without a GPU they run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the
GPU on CUDA tensors; the twins run on the CPU.

* ``moe_sum`` adds in the reference's order (fp32, from zero, in increasing expert id, then the
  shared output) and picks each row exactly: bit for bit.
* ``swiglu`` does the twin's operations in its order; ``exp`` comes from another library (CUDA's or
  numpy's against torch's CPU one), which moves ``silu`` by an ulp now and then and so, rarely, the
  bf16 result by one bf16 ulp. Check: within one bf16 ulp (2**-7 of the value) and at least 99%
  bit-equal (measured: 100%); a missing clamp or a sigmoid in place of silu fails it.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.kernels.reference import ReferenceKernels  # noqa: E402
from tests.kernel_checks import device, one_bf16_ulp_mismatch  # noqa: E402

TWIN = ReferenceKernels(batch_invariant=False)


def on_device(*xs):
    return [x.to(device()) for x in xs]


def routed_inputs(n: int, k: int, d: int, experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-8, 8, (n, k, 1), generator=gen).float())
    routed = (torch.randn(n, k, d, generator=gen) * magnitudes).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])  # distinct per token
    shared = torch.randn(n, d, generator=gen).bfloat16()
    return routed, ids, shared


@pytest.mark.parametrize("n,k,d,experts", [(1, 6, 5120, 384), (7, 6, 256, 16), (64, 2, 1000, 4), (3, 1, 64, 8)])
def test_moe_sum_is_the_twin_bit_for_bit(n, k, d, experts):
    from model.kernels.triton_moe_sum import moe_sum

    inputs = routed_inputs(n, k, d, experts, seed=n + k)
    got = moe_sum(*on_device(*inputs)).cpu()
    ref = TWIN.moe_sum(*inputs)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_moe_sum_order_matters_and_is_the_expert_order():
    """Values whose fp32 sum depends on the order: the kernel must follow the ids, not the slots."""
    from model.kernels.triton_moe_sum import moe_sum

    routed = torch.tensor([[[2.0 ** 24], [1.0], [-(2.0 ** 24)], [1.0]]]).bfloat16().expand(1, 4, 1).contiguous()
    shared = torch.zeros(1, 1).bfloat16()
    for ids in ([[0, 1, 2, 3]], [[0, 2, 1, 3]], [[3, 1, 2, 0]]):
        ids = torch.tensor(ids)
        got = moe_sum(*on_device(routed, ids, shared)).cpu()
        assert torch.equal(got, TWIN.moe_sum(routed, ids, shared)), ids
    assert not torch.equal(TWIN.moe_sum(routed, torch.tensor([[0, 1, 2, 3]]), shared),
                           TWIN.moe_sum(routed, torch.tensor([[0, 2, 1, 3]]), shared))  # the test can tell


def swiglu_mismatch(got, ref) -> str | None:
    return one_bf16_ulp_mismatch(got, ref, min_bit_equal=0.99)


@pytest.mark.parametrize("n,i,limit", [(1, 2304, 10.0), (9, 300, 10.0), (64, 128, 0.0)])
def test_swiglu_matches_the_twin(n, i, limit):
    from model.kernels.triton_moe_sum import swiglu

    gen = torch.Generator().manual_seed(n + i)
    gate, up = (torch.randn(2, n, i, generator=gen) * 8).bfloat16()
    got = swiglu(*on_device(gate, up), limit).cpu()
    assert (failure := swiglu_mismatch(got, TWIN.swiglu(gate, up, limit))) is None, failure


def test_swiglu_check_rejects_a_wrong_arithmetic():
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(2, 64, 256, generator=gen) * 8).bfloat16()
    ref = TWIN.swiglu(gate, up, 10.0)
    assert swiglu_mismatch(TWIN.swiglu(gate, up, 0.0), ref) is not None, "no clamp"
    assert swiglu_mismatch((torch.sigmoid(gate.float()) * up.float()).bfloat16(), ref) is not None, "sigmoid"
