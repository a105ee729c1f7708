"""The routing kernel (``model/kernels/triton_route.py``) against its twin (``model.routing.route``).

Without a GPU it runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``), on the GPU on
CUDA tensors; the twin runs on the CPU.

Tolerance. The kernel does the twin's fp32 operations in its order but for two: ``exp`` and
``log1p`` come from another library (CUDA's, or Kahan's formula in the interpreter, against
torch's CPU ones), each within an ulp or two of the exact value, so a score may differ by a few
ulps; and the k weights are summed in pick order. So:

* the experts: every expert the kernel picks has a biased score (the twin's) no lower than the
  twin's k-th by more than ``2**-20`` of its magnitude (a few ulps: only near-ties may swap), and
  the picks come in descending order within the same margin; with random logits the sets are
  equal in nearly every row (checked: at least 99%);
* the weights: within ``2**-18`` (relative) of the twin's rule applied to the kernel's picks.

A wrong rule fails: the weights of biased scores, no normalization, or ``softplus`` without the
square root are far outside these bounds (``test_the_check_rejects_a_wrong_rule``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.routing import RoutingRule, route  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

SCORE_MARGIN = 2.0 ** -20
WEIGHT_TOLERANCE = 2.0 ** -18


def logits_and_bias(n: int, experts: int, seed: int, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=gen) * scale
    logits[0, :3] = 25.0  # above softplus's threshold: the score is the logit itself
    bias = torch.randn(experts, generator=gen) * 0.1
    return logits, bias


def _scores(logits, bias, rule):
    scores = torch.nn.functional.softplus(logits / rule.temperature).sqrt()
    return scores, scores + bias


def mismatch(weights, ids, logits, bias, rule) -> str | None:
    """Why the kernel's (weights, ids) do not follow the twin within the tolerance; None if they do."""
    ref_weights, ref_ids = route(logits, bias, rule)
    scores, biased = _scores(logits, bias, rule)
    kth = biased.gather(1, ref_ids[:, -1:])
    mine = biased.gather(1, ids)
    margin = SCORE_MARGIN * biased.abs().amax(dim=1, keepdim=True)
    if (mine < kth - margin).any():
        return "an expert below the twin's k-th biased score"
    if (mine[:, 1:] > mine[:, :-1] + margin).any():
        return "picks not in descending biased-score order"
    if any(len(set(row.tolist())) != rule.top_k for row in ids):
        return "an expert picked twice"
    same = (ids.sort(dim=1).values == ref_ids.sort(dim=1).values).all(dim=1).float().mean().item()
    if same < 0.99:
        return f"only {same:.2%} of the rows pick the twin's experts"
    picked = scores.gather(1, ids)
    normalized = rule.norm_topk_prob and rule.top_k > 1  # one expert keeps its score
    expected = picked / (picked.sum(dim=1, keepdim=True) + 1e-20) if normalized else picked
    expected = expected * rule.route_scale
    worst = ((weights - expected).abs() / (expected.abs() * WEIGHT_TOLERANCE + 1e-30)).max().item()
    return f"weights {worst:.3g} times the tolerance apart" if worst > 1.0 else None


RULES = [
    RoutingRule(top_k=6, score_func="sqrtsoftplus", norm_topk_prob=True, route_scale=1.5, temperature=1.0),
    RoutingRule(top_k=2, score_func="sqrtsoftplus", norm_topk_prob=False, route_scale=1.0, temperature=0.7),
    RoutingRule(top_k=1, score_func="sqrtsoftplus", norm_topk_prob=True, route_scale=2.5, temperature=1.0),
]


@pytest.mark.parametrize("n,experts", [(1, 384), (7, 384), (64, 16), (300, 8)])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"k{r.top_k}")
def test_matches_the_twin(n, experts, rule):
    from model.kernels.triton_route import route as kernel_route

    if rule.top_k > experts:
        pytest.skip("more picks than experts")
    logits, bias = logits_and_bias(n, experts, seed=n + experts + rule.top_k)
    weights, ids = kernel_route(logits.to(device()), bias.to(device()), rule)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (n, rule.top_k)
    assert (failure := mismatch(weights.cpu(), ids.cpu(), logits, bias, rule)) is None, failure


def test_equal_scores_pick_the_lowest_ids_first():
    from model.kernels.triton_route import route as kernel_route

    rule = RULES[0]
    logits, bias = torch.zeros(2, 16), torch.zeros(16)
    logits[1, 9] = 1.0
    weights, ids = kernel_route(logits.to(device()), bias.to(device()), rule)
    assert ids.cpu().tolist() == [[0, 1, 2, 3, 4, 5], [9, 0, 1, 2, 3, 4]]
    assert torch.allclose(weights.cpu()[0], torch.full((6,), 1.5 / 6))


def test_the_check_rejects_a_wrong_rule():
    rule = RULES[0]
    logits, bias = logits_and_bias(64, 384, seed=5)
    weights, ids = route(logits, bias, rule)
    assert mismatch(weights, ids, logits, bias, rule) is None  # the twin passes its own check
    scores, biased = _scores(logits, bias, rule)
    wrong_weights = biased.gather(1, ids)
    wrong_weights = wrong_weights / wrong_weights.sum(dim=1, keepdim=True) * rule.route_scale
    assert mismatch(wrong_weights, ids, logits, bias, rule) is not None, "weights of biased scores"
    assert mismatch(scores.gather(1, ids) * rule.route_scale, ids, logits, bias, rule) is not None, "not normalized"
    unsquared = torch.nn.functional.softplus(logits)
    no_sqrt_ids = (unsquared + bias).topk(6, dim=-1)[1]
    assert mismatch(weights, no_sqrt_ids, logits, bias, rule) is not None, "softplus without the square root"


def test_the_backend_routes_through_the_kernel_only_for_sqrtsoftplus():
    from model.kernels.triton_backend import TritonKernels

    logits, bias = logits_and_bias(5, 16, seed=2)
    softmax = RoutingRule(top_k=2, score_func="softmax", norm_topk_prob=True, route_scale=1.0, temperature=1.0)
    weights, ids = TritonKernels().route(logits.to(device()), bias.to(device()), softmax)
    ref_weights, ref_ids = route(logits, bias, softmax)
    assert torch.equal(ids.cpu(), ref_ids) and torch.allclose(weights.cpu(), ref_weights)
