"""The indexer-score kernel (``model/kernels/triton_index_scores.py``) against its twin
(``ReferenceKernels.index_scores``).

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the
GPU on CUDA tensors; the twin runs on the CPU.

Tolerance. Both sides round in the same places (the dot product to bf16, the weighted value to
bf16, the sum to bf16); only the order of the fp32 sums differs. That can carry a head's dot
product, now and then, across a bf16 rounding boundary: its weighted term then moves by at most
``2**-7 * |w_h relu(q_h . k)|`` (one bf16 ulp of each rounding it passes through, twice), and the
final rounding adds one ulp of the score. So

    |kernel - twin| <= 2**-7 * |twin| + 2**-6 * sum_h |w_h| relu(q_h . k)

and, flips being rare, at least 95% of the scores bit-equal (measured: 99-100%). The heads' weights
can be negative, so a score can be much smaller than its terms: the bound is relative to the terms.
A missing ReLU, a weight left out or the heads summed without their weights fail it
(``test_the_check_rejects_a_wrong_arithmetic``). The selection is compared tie-aware: an entry
only one side selects must score within the tolerance of the other side's last selected entry.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.kernels.reference import ReferenceKernels  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

TWIN = ReferenceKernels(batch_invariant=False)


def random_inputs(t: int, h: int, d: int, e: int, sequences: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen).bfloat16()
    weights = (torch.randn(t, h, generator=gen) * h ** -0.5).bfloat16()  # both signs, as weights_proj gives
    keys = torch.randn(sequences, e, d, generator=gen).bfloat16()
    seq = torch.randint(0, sequences, (t,), generator=gen)
    return q, weights, keys, seq


def kernel(q, weights, keys, seq):
    from model.kernels.triton_index_scores import index_scores

    return index_scores(q.to(device()), weights.to(device()), keys.to(device()), seq.to(device())).cpu()


def term_magnitude(q, weights, keys, seq) -> torch.Tensor:
    """``sum_h |w_h| relu(q_h . k)`` per (query, entry), in fp32."""
    dots = torch.bmm(q.float(), keys[seq].float().transpose(1, 2)).relu()
    return (dots * weights.float().abs().unsqueeze(-1)).sum(dim=1)


def tolerance(inputs, ref) -> torch.Tensor:
    return ref.float().abs() * 2.0 ** -7 + term_magnitude(*inputs) * 2.0 ** -6 + 1e-30


def mismatch(got, ref, inputs) -> str | None:
    worst = ((got.float() - ref.float()).abs() / tolerance(inputs, ref)).max().item()
    if worst > 1.0:
        return f"{worst:.3g} times the tolerance"
    equal = (got == ref).float().mean().item()
    return None if equal >= 0.95 else f"only {equal:.2%} bit-equal"


SHAPES = [  # (T, H, d, E, sequences)
    (1, 16, 64, 1, 1), (7, 16, 64, 50, 2), (5, 64, 128, 200, 3), (33, 64, 128, 640, 4), (64, 32, 128, 129, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-d{}-E{}-B{}".format(*s))
def test_matches_the_twin(shape):
    inputs = random_inputs(*shape, seed=sum(shape))
    got, ref = kernel(*inputs), TWIN.index_scores(*inputs)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert (failure := mismatch(got, ref, inputs)) is None, failure


def test_top_k_selection_agrees_up_to_ties():
    inputs = random_inputs(33, 64, 128, 640, 4, seed=11)
    got, ref = kernel(*inputs).float(), TWIN.index_scores(*inputs).float()
    k = 64
    slack = tolerance(inputs, TWIN.index_scores(*inputs))
    ours, theirs = got.topk(k).indices, ref.topk(k).indices
    for row in range(got.shape[0]):
        kth = ref[row].topk(k).values[-1]
        for entry in set(ours[row].tolist()) ^ set(theirs[row].tolist()):
            assert (ref[row, entry] - kth).abs() <= 2 * slack[row, entry], (row, entry)


def test_rows_do_not_depend_on_the_batch():
    inputs = random_inputs(20, 16, 64, 150, 3, seed=5)
    batched = kernel(*inputs)
    q, weights, keys, seq = inputs
    for chosen in (slice(0, 1), slice(7, 9), slice(19, 20)):
        assert torch.equal(kernel(q[chosen], weights[chosen], keys, seq[chosen]), batched[chosen]), chosen


def test_the_check_rejects_a_wrong_arithmetic():
    inputs = random_inputs(9, 64, 128, 200, 2, seed=6)
    q, weights, keys, seq = inputs
    ref = TWIN.index_scores(*inputs)
    per_head = torch.bmm(q, keys[seq].transpose(1, 2))
    wrong = {
        "no relu": (per_head * weights.unsqueeze(-1)).sum(dim=1),
        "no weights": per_head.relu().sum(dim=1),
        "a head left out": (per_head.relu()[:, 1:] * weights[:, 1:].unsqueeze(-1)).sum(dim=1),
    }
    for name, value in wrong.items():
        assert mismatch(value, ref, inputs) is not None, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_real_shapes_on_cuda(t):
    """V4.1-Flash: 64 heads of 128, 2,048 entries (8K tokens at ratio 4); both sides on the GPU."""
    inputs = [x.cuda() for x in random_inputs(t, 64, 128, 2048, 4, seed=t)]
    from model.kernels.triton_index_scores import index_scores

    got, ref = index_scores(*inputs).cpu(), TWIN.index_scores(*inputs).cpu()
    assert (failure := mismatch(got, ref, [x.cpu() for x in inputs])) is None, failure
