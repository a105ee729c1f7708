"""The sampler's per-row logsumexp and argmax on CUDA (``model/kernels/triton_greedy.py``) against
torch's, in Triton's interpreter (and on CUDA when there is one).

Tolerance: the argmax exactly (ties to the lowest id); the logsumexp within 4 fp32 ulps of torch's
(the same function, its sums in another order) and exactly ``-inf`` for a row of ``-inf``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from model.kernels.triton_greedy import CHUNK, row_lse_and_argmax  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def _rows(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, vocab, generator=gen) * 4
    logits[1, 7] = logits[1, vocab - 3] = logits[1].max() + 1  # a tie across chunks: the lower id wins
    logits[2, : vocab // 2] = -torch.inf  # the first chunks all -inf
    logits[3] = -torch.inf  # a row of -inf: token 0, lse -inf
    logits[4, 3 * vocab // 4:] = 50.0  # a run of equal maxima inside one chunk
    return logits


@pytest.mark.parametrize("vocab", [1000, 3 * CHUNK + 17])  # one chunk; several, the last partial
def test_matches_torch(vocab):
    logits = _rows(vocab, vocab)
    processed = logits.clone()
    processed[0, 11] = 1e4  # the argmax reads the processed logits, the logsumexp the raw ones
    lse, token = row_lse_and_argmax(logits.to(device()), processed.to(device()))
    assert torch.equal(token.cpu(), torch.argmax(processed, dim=-1))
    ref = torch.logsumexp(logits, dim=-1)
    got = lse.cpu()
    assert got[3] == -torch.inf and ref[3] == -torch.inf
    finite = torch.isfinite(ref)
    ulp = torch.finfo(torch.float32).eps * ref[finite].abs().clamp(min=1.0)
    assert ((got[finite] - ref[finite]).abs() <= 4 * ulp).all(), (got, ref)


def test_same_tensor_for_both():
    logits = _rows(2 * CHUNK, 3)
    lse, token = row_lse_and_argmax(logits.to(device()), logits.to(device()))
    assert torch.equal(token.cpu(), torch.argmax(logits, dim=-1))


def test_chosen_logprob_matches_log_softmax():
    """What the sampler reports: ``raw[token] - lse`` against torch's ``log_softmax`` gathered."""
    logits = _rows(CHUNK + 5, 9)[[0, 1, 2, 4]]
    lse, token = row_lse_and_argmax(logits.to(device()), logits.to(device()))
    chosen = logits.gather(1, token.cpu()[:, None]).squeeze(1) - lse.cpu()
    ref = torch.log_softmax(logits, dim=-1).gather(1, token.cpu()[:, None]).squeeze(1)
    assert torch.allclose(chosen, ref, rtol=0, atol=4e-6 * max(1.0, float(logits.abs().max())))
