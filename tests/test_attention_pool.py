"""The attention's row pool (``Attention._gather_entries``): however the pool holds the compressed
entries (each sequence's decoded once, or each query's selection), every query attends to the same
rows, so the model's outputs and cache are the same bit for bit (CPU, the engine's batch-invariant
arithmetic), through chunked prefills of several sequences and decode steps."""

from __future__ import annotations

import pytest
import torch

import model.attention as attention
from model.batch import ForwardBatch
from model.cache import V41Cache

BLOCK = 16
PROMPTS = [[3 + (i * 11 + j * 7) % 500 for j in range(n)] for i, n in enumerate((9, 40, 70))]


def _run(tiny_model) -> tuple[torch.Tensor, V41Cache]:
    """Two prefill chunks of every prompt in one batch each, then four decode steps; all logits."""
    cache = V41Cache.allocate(tiny_model.cfg, 1 + 3 * 8, len(PROMPTS), BLOCK)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(PROMPTS))]
    slots = list(range(len(PROMPTS)))
    logits = []
    halves = [len(p) // 2 for p in PROMPTS]
    for first in (True, False):
        chunks = [p[:h] if first else p[h:] for p, h in zip(PROMPTS, halves)]
        starts = [0] * len(PROMPTS) if first else halves
        logits.append(tiny_model.logits(tiny_model.forward(ForwardBatch.build(chunks, starts, slots, tables), cache)))
    for step in range(4):
        tokens = [[5 + (step * 13 + i) % 700] for i in range(len(PROMPTS))]
        positions = [len(p) + step for p in PROMPTS]
        logits.append(tiny_model.logits(tiny_model.forward(ForwardBatch.build(tokens, positions, slots, tables), cache)))
    return torch.cat(logits), cache


@pytest.mark.parametrize("choice", [False, True], ids=["each-query", "each-sequence"])
def test_the_pool_of_compressed_entries_changes_no_bit(tiny_model, monkeypatch, choice):
    base, base_cache = _run(tiny_model)
    chosen = []
    monkeypatch.setattr(attention, "sequence_entries_pay", lambda *args: chosen.append(args) or choice)
    forced, forced_cache = _run(tiny_model)
    assert chosen, "the compressed layers never chose how to hold their entries"
    assert torch.equal(forced, base)
    for layer in range(tiny_model.cfg.num_layers):
        slots, ring = torch.arange(len(PROMPTS)).unsqueeze(-1), torch.arange(tiny_model.cfg.sliding_window)
        assert torch.equal(forced_cache.read_window(layer, slots, ring), base_cache.read_window(layer, slots, ring))


def test_lists_shared_across_layers_change_no_bit(tiny_model, monkeypatch):
    """``ForwardState.once`` hands later layers the lists an earlier one computed; computing them in
    every layer instead gives the same logits and cache, and a state passed to a second forward does
    not hand it the first one's lists."""
    shared, _ = _run(tiny_model)
    computed = []
    real_once = attention.ForwardState.once
    monkeypatch.setattr(attention.ForwardState, "once", lambda self, key, compute: computed.append(key) or compute())
    every_layer, _ = _run(tiny_model)
    assert torch.equal(every_layer, shared)
    assert computed.count(("window lists",)) > len(PROMPTS), "the lists were not asked for by every layer"
    monkeypatch.setattr(attention.ForwardState, "once", real_once)

    cache = V41Cache.allocate(tiny_model.cfg, 1 + 3 * 8, len(PROMPTS), BLOCK)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(PROMPTS))]
    state = attention.ForwardState()
    reused = [tiny_model.forward(ForwardBatch.build([p[:n]], [0], [i], [tables[i]]), cache, state)
              for i, (p, n) in enumerate(zip(PROMPTS, (5, 30, 60)))]
    fresh_cache = V41Cache.allocate(tiny_model.cfg, 1 + 3 * 8, len(PROMPTS), BLOCK)
    fresh = [tiny_model.forward(ForwardBatch.build([p[:n]], [0], [i], [tables[i]]), fresh_cache)
             for i, (p, n) in enumerate(zip(PROMPTS, (5, 30, 60)))]
    assert all(torch.equal(a, b) for a, b in zip(reused, fresh))
