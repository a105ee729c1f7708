"""Engram's n-gram hashing kernel (``model/kernels/triton_ngram_hash.py``) against its torch twin
(``model.engram.ngram_hash_ids``): integer arithmetic, so the ids must be equal, element for element.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from model.engram import ngram_hash_ids  # noqa: E402
from model.kernels.triton_ngram_hash import ngram_hash_ids as kernel_hash_ids  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def hash_inputs(chunks: list[tuple[int, int]], layers: int, ngram: int, heads: int, seed: int):
    """Chunks ``(start, length)`` of one sequence each, laid out one after the other as a forward's
    tokens; random compressed ids, history rings, multipliers and primes of the real magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    positions, start, offset, slot = [], [], [], []
    for b, (first, length) in enumerate(chunks):
        positions += range(first, first + length)
        start += [first] * length
        offset += [sum(n for _, n in chunks[:b])] * length
        slot += [b] * length
    t = len(positions)
    compressed = torch.randint(0, 100_000, (t,), generator=gen)
    history = torch.randint(0, 100_000, (len(chunks) + 1, ngram - 1), generator=gen)
    multipliers = torch.randint(0, 2**40, (layers, ngram), generator=gen) * 2 + 1  # odd, no int64 overflow
    primes = torch.randint(1_000, 2_000_000, (layers, ngram - 1, heads), generator=gen)
    flat = primes.flatten(1)
    offsets = torch.cumsum(flat, dim=1) - flat
    as_long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return (compressed, as_long(positions), as_long(start), as_long(offset), as_long(slot), history, 7, multipliers,
            primes, offsets)


def assert_equal_to_twin(inputs) -> None:
    got = kernel_hash_ids(*(x.to(device()) if isinstance(x, torch.Tensor) else x for x in inputs)).cpu()
    ref = ngram_hash_ids(*inputs)
    assert got.dtype == ref.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(got, ref), f"{(got != ref).sum()} ids differ"


@pytest.mark.parametrize("chunks", [
    [(0, 40)],  # a prompt from its first token: the pad id before the start
    [(0, 5), (37, 1), (12, 9), (1, 1)],  # a first chunk, decode steps, a later chunk, position 1
    [(100, 1)] * 33,  # a decode step of 33 sequences: every lookback from the history ring
])
def test_matches_the_torch_twin(chunks):
    assert_equal_to_twin(hash_inputs(chunks, layers=3, ngram=3, heads=8, seed=len(chunks)))


def test_other_sizes_match():
    """4-grams, one layer, a head count that is not a power of two."""
    assert_equal_to_twin(hash_inputs([(0, 7), (50, 3), (2, 1)], layers=1, ngram=4, heads=5, seed=3))


def test_a_wrong_lookback_is_caught():
    inputs = list(hash_inputs([(0, 5), (37, 1)], layers=2, ngram=3, heads=4, seed=4))
    ref = ngram_hash_ids(*inputs)
    inputs[5] = inputs[5] + 1  # the history ring changed: the decode step's ids must change
    assert not torch.equal(kernel_hash_ids(*(x.to(device()) if isinstance(x, torch.Tensor) else x
                                             for x in inputs)).cpu(), ref)
