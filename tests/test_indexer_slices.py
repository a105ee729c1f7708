"""The indexer scores a long prefill a slice of queries at a time (bounded memory); slicing must
change no selection and no bit of the forward."""

from __future__ import annotations

import copy

import torch

from model import indexer
from model.attention import ForwardState
from model.batch import ForwardBatch
from model.cache import V41Cache

BLOCK = 16


def _prefill(model, monkeypatch, score_elements: int | None):
    if score_elements is not None:
        monkeypatch.setattr(indexer, "SCORE_ELEMENTS", score_elements)
    prompts = [[3 + (i * 11 + j * 5) % 700 for j in range(n)] for i, n in enumerate((90, 37, 120))]
    cache = V41Cache.allocate(model.cfg, 1 + 3 * 8, 3, BLOCK)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    state = ForwardState()
    hidden = model.forward(ForwardBatch.build(prompts, [0, 0, 0], [0, 1, 2], tables), copy.deepcopy(cache), state)
    return hidden, state


def test_sliced_scoring_equals_one_slice(tiny_model, monkeypatch):
    whole, whole_state = _prefill(tiny_model, monkeypatch, None)
    sliced, sliced_state = _prefill(tiny_model, monkeypatch, 1)  # one query per slice
    assert torch.equal(whole, sliced)
    assert whole_state.selections.keys() == sliced_state.selections.keys()
    for layer, selection in whole_state.selections.items():
        other = sliced_state.selections[layer]
        assert torch.equal(selection.entries, other.entries) and torch.equal(selection.counts, other.counts)
    assert torch.equal(whole_state.candidates, sliced_state.candidates)


def test_best_blocks_keeps_the_top_blocks_above_minus_infinity():
    """The first level's block choice, against a plain ranking (score descending, then block id):
    with fewer blocks than it keeps (no sort: every V4.1 context below 64K) and with more."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (5, 9), generator=generator).float().bfloat16()
    scores[0, 4:] = -torch.inf  # blocks a query cannot see
    scores[1, :] = -torch.inf
    scores[2, 6] = torch.inf  # the query's newest block
    for keep in (2, 5, 9, 12):
        expected = torch.zeros(scores.shape, dtype=torch.bool)
        for row in range(scores.shape[0]):
            ranked = sorted(range(scores.shape[1]), key=lambda b: (-float(scores[row, b]), b))[:keep]
            for b in ranked:
                expected[row, b] = float(scores[row, b]) > float("-inf")
        assert torch.equal(indexer.best_blocks(scores, keep), expected), keep
