"""The padded decode batch (what a CUDA graph replays) against the general forward, on CPU.

A padded decode batch fixes every shape: the indexer scores a fixed number of keys, attention runs
every listed column, rows that do not close a compressor group write a not yet visible entry, and
rows beyond the real ones write a scratch slot and block. In the engine's packed layout a row's
attention does not depend on its list's width (whole 64-entry blocks), so the padded batch
computes what the general forward computes, bit for bit (batch-invariant mode, fixed input tokens
so that both see the same ones), whatever its padding rows and context bucket.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model.batch import ForwardBatch
from model.cache import V41Cache
from model.sparse_attention import sparse_attention_padded
from workers.cuda_graphs import DecodeGraphs, GraphPlan, batch_buckets, context_buckets

BLOCK = 16
PROMPTS = [[3 + (i * 7 + j * 5) % 300 for j in range(n)] for i, n in enumerate((5, 17, 33, 40, 64))]
STEPS = 12


def _prefilled(model, num_slots: int, num_blocks: int):
    """A cache holding every prompt (sequence i in slot i, blocks from one counter), and their tables."""
    cache = V41Cache.allocate(model.cfg, num_blocks, num_slots, BLOCK)
    tables, next_block = [], 1
    longest = max(map(len, PROMPTS)) + STEPS
    for i, prompt in enumerate(PROMPTS):
        blocks = -(-longest // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        model.forward(ForwardBatch.build([prompt], [0], [i], [tables[-1]]), cache)
    return cache, tables


def _plan(rows: int, key_tokens: int) -> GraphPlan:
    return GraphPlan.grid([rows], [key_tokens], BLOCK, max_previous_rows=len(PROMPTS))


def _forced_tokens(step: int) -> list[int]:
    """The input tokens of a decode step: fixed (not sampled), so that both paths see the same ones."""
    return [5 + (step * 31 + i * 17) % 900 for i in range(len(PROMPTS))]


def _decode_general(model, cache, tables):
    starts = [len(p) for p in PROMPTS]
    out = []
    for step in range(STEPS):
        batch = ForwardBatch.build([[t] for t in _forced_tokens(step)], [s + step for s in starts],
                                   list(range(len(PROMPTS))), tables)
        out.append(model.logits(model.forward(batch, cache)))
    return torch.stack(out)


def _decode_padded(model, cache, tables, rows: int, key_tokens: int, scratch_slot: int, scratch_block: int):
    graphs = DecodeGraphs(model, cache, _plan(rows, key_tokens), scratch_slot, scratch_block)
    starts = [len(p) for p in PROMPTS]
    n = len(PROMPTS)
    out, last = [], torch.zeros(0, dtype=torch.long)
    for step in range(STEPS):
        # odd steps take their tokens from the previous step's "samples" on the device, as under
        # zero-overhead scheduling (placeholders on the host)
        from_device = step % 2 == 1
        tokens = [0] * n if from_device else _forced_tokens(step)
        previous = list(range(n)) if from_device else [-1] * n
        graphs.load(tokens, [s + step for s in starts], list(range(n)), previous, tables, (rows, key_tokens), last)
        graphs.run_eager((rows, key_tokens))
        out.append(graphs.logits[:n].clone())
        last = torch.tensor(_forced_tokens(step + 1))
    return torch.stack(out)


@pytest.fixture(scope="module")
def prefilled(tiny_model):
    n = len(PROMPTS)
    blocks = 1 + n * -(-(max(map(len, PROMPTS)) + STEPS) // BLOCK)
    cache, tables = _prefilled(tiny_model, n + 1, blocks + 1)  # + the scratch slot and block
    return cache, tables, n, blocks


def test_padded_decode_matches_general_forward(tiny_model, prefilled):
    cache, tables, n, blocks = prefilled
    general = _decode_general(tiny_model, copy.deepcopy(cache), tables)
    padded = _decode_padded(tiny_model, copy.deepcopy(cache), tables, rows=8, key_tokens=256,
                            scratch_slot=n, scratch_block=blocks)
    assert torch.equal(general, padded)


def test_padding_rows_and_buckets_change_no_real_row(tiny_model, prefilled):
    """A real row's logits are the same with 0 or 11 padding rows and with any context bucket (keys
    beyond a row's visible ones never count), and the padding rows leave every real sequence's
    cache state untouched."""
    cache, tables, n, blocks = prefilled
    runs, states = [], []
    for rows, key_tokens in ((n, 128), (16, 128), (8, 512)):
        states.append(copy.deepcopy(cache))
        runs.append(_decode_padded(tiny_model, states[-1], tables, rows, key_tokens, n, blocks))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    unpadded, padded = states[0], states[1]
    cfg = tiny_model.cfg
    slots, ring = torch.arange(n).unsqueeze(-1), torch.arange(cfg.sliding_window)
    for layer in range(cfg.num_layers):
        assert torch.equal(unpadded.read_window(layer, slots, ring), padded.read_window(layer, slots, ring))
    real_blocks = torch.arange(1, blocks).unsqueeze(-1)
    for layer in cfg.kv_source_layers:
        rows = torch.arange(BLOCK // cfg.compress_ratios[layer])
        for read in ("read_compressed_kv", "read_index_keys"):
            assert torch.equal(getattr(unpadded, read)(layer, real_blocks, rows),
                               getattr(padded, read)(layer, real_blocks, rows))
    assert torch.equal(unpadded.engram_history[:n], padded.engram_history[:n])


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(256, (4, 300, 1)) == [1, 4, 256]
    assert context_buckets(8192) == [1024, 2048, 4096, 8192]
    assert context_buckets(3000) == [1024, 2048, 3000]
    assert context_buckets(200) == [200]


def test_long_contexts_are_captured_at_fewer_batch_sizes():
    """Up to 8,192 tokens every batch size; beyond, the powers of two (and the largest) up to 2^23
    rows x context tokens (the smallest size always): graphs reach the longest context a sequence
    may have, with a bounded number of graphs and bounded memory."""
    from engine_core.config import EngineConfig

    plan = GraphPlan.from_config(EngineConfig(model="tiny", device="cuda", max_num_seqs=256), max_model_len=100_000)
    assert plan.context_sizes == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000]
    assert plan.rows_at(8192) == batch_buckets(256)
    assert plan.rows_at(16384) == plan.rows_at(32768) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert plan.rows_at(65536)[-1] == 128 and plan.rows_at(100_000)[-1] == 64
    assert all(rows * tokens <= 2**23 for rows, tokens in plan.buckets)
    assert plan.widest_rows[-2:] == [(128, 65536), (64, 100_000)]
    few = GraphPlan.from_config(EngineConfig(model="tiny", device="cuda", max_num_seqs=24), max_model_len=8216)
    assert few.rows_at(8216) == [1, 2, 4, 8, 16, 24]  # the largest size too
    narrow = GraphPlan.from_config(EngineConfig(model="tiny", device="cuda", max_num_seqs=8,
                                                max_seq_len_to_capture=2000), 100_000)
    assert narrow.buckets == tuple((rows, tokens) for tokens in (1024, 2000) for rows in (1, 2, 4, 8))
    # a bucket's block tables are as wide as its context needs
    assert plan.input_shape((4, 1024)) == (4, 4 + 1024 // 128)
    assert plan.input_shape((2, 100_000)) == (2, 4 + 782)


def test_padded_attention_does_not_depend_on_the_list_width():
    """Holes appended to every list (any number, across 64-entry blocks) change no row's output."""
    generator = torch.Generator().manual_seed(0)
    t, h, d, width = 6, 4, 32, 70
    q = torch.randn(t, h, d, generator=generator).bfloat16()
    kv = torch.randn(t, width, d, generator=generator).bfloat16()
    valid = torch.rand(t, width, generator=generator) > 0.3
    sink = torch.randn(h, generator=generator)
    base = sparse_attention_padded(q, kv, valid, sink, 0.2)
    for extra in (1, 58, 64, 130):
        padded_kv = torch.cat([kv, torch.randn(t, extra, d, generator=generator).bfloat16()], dim=1)
        padded_valid = torch.cat([valid, torch.zeros(t, extra, dtype=torch.bool)], dim=1)
        assert torch.equal(sparse_attention_padded(q, padded_kv, padded_valid, sink, 0.2), base)


def test_every_rank_picks_the_same_graph_from_the_whole_plan(tiny_model):
    """Under expert parallelism all ranks must run the same exchanges: the bucket comes from the
    step's shape over every rank (the busiest rank's size, the longest context), an idle rank
    included, and one rank's prefill makes the whole step eager."""
    from engine_core.protocol import SequenceStep
    from workers.cuda_graphs import StepShape

    def decode(seq_id: int, start: int) -> SequenceStep:
        return SequenceStep(seq_id, 0, start, [5], seq_id, list(range(1, 2 + start // BLOCK)), True)

    cache = V41Cache.allocate(tiny_model.cfg, 4, 2, BLOCK)
    graphs = DecodeGraphs(tiny_model, cache, GraphPlan.grid([1, 2, 4, 8], [64, 128], BLOCK, 8), 1, 3)
    busy, idle = [decode(1, 10), decode(2, 70), decode(3, 3)], []
    shape = StepShape.of([busy, idle])
    assert (shape.decode_only, shape.rows, shape.longest_context) == (True, 3, 71)
    assert graphs.bucket(shape) == (4, 128)
    assert graphs.bucket(StepShape.of([idle, idle])) == (1, 64)  # nothing anywhere: the smallest graph
    prefill = SequenceStep(4, 0, 0, [5, 6, 7], 0, [1], True)
    assert graphs.bucket(StepShape.of([busy, [prefill]])) is None
    assert graphs.bucket(StepShape.of([[decode(i, 1) for i in range(9)]])) is None  # beyond the largest size
    assert graphs.bucket(StepShape.of([[decode(1, 128)]])) is None  # beyond the longest context


def test_a_step_replays_the_cheapest_bucket_that_covers_it(tiny_model, monkeypatch):
    """The shortest context that covers the longest sequence (and its block table), then the fewest
    rows; a step with more rows than that context's buckets hold takes a longer context, or none."""
    from engine_core.protocol import SequenceStep
    from workers import cuda_graphs
    from workers.cuda_graphs import StepShape

    def decode(seq_id: int, start: int, blocks: int | None = None) -> SequenceStep:
        return SequenceStep(seq_id, 0, start, [5], seq_id, [1] * (blocks or 1 + start // BLOCK), True)

    cache = V41Cache.allocate(tiny_model.cfg, 4, 2, BLOCK)
    monkeypatch.setattr(cuda_graphs, "GRAPH_ROW_TOKENS", 4 * 128)
    plan = GraphPlan.grid([1, 2, 3, 4], [64, 128, 256], BLOCK, 8, long_context=64)
    assert plan.buckets == ((1, 64), (2, 64), (3, 64), (4, 64), (1, 128), (2, 128), (4, 128), (1, 256), (2, 256))
    graphs = DecodeGraphs(tiny_model, cache, plan, 1, 3)
    assert graphs.bucket(StepShape.of([[decode(1, 10), decode(2, 63)]])) == (2, 64)
    assert graphs.bucket(StepShape.of([[decode(1, 10), decode(2, 64)]])) == (2, 128)
    assert graphs.bucket(StepShape.of([[decode(1, 10, blocks=5)]])) == (1, 128)  # its table needs 5 columns
    assert graphs.bucket(StepShape.of([[decode(i, 100) for i in range(3)]])) == (4, 128)
    assert graphs.bucket(StepShape.of([[decode(i, 200) for i in range(3)]])) is None  # 2 rows only at 256
    assert graphs.bucket(StepShape.of([[decode(1, 200)]])) == (1, 256)
    assert graphs.inputs((1, 256)).shape == (1, 4 + 16) and graphs.inputs((4, 64)).shape == (4, 4 + 4)


def test_load_fills_the_static_inputs(tiny_model):
    """``load`` writes each real row's token, position, slot, previous-step row and block table (the
    unused columns block 0), and the padding row below them, in the bucket's rows."""
    cache = V41Cache.allocate(tiny_model.cfg, 4, 2, BLOCK)
    graphs = DecodeGraphs(tiny_model, cache, GraphPlan.grid([1, 2, 4, 8], [64, 128], BLOCK, 8), scratch_slot=1,
                          scratch_block=3)
    graphs.inputs((8, 128)).fill_(99)
    graphs.load([5, 6, 7], [10, 70, 3], [0, 2, 1], [-1, 0, 1], [[1], [1, 2, 3, 4, 5], []], (4, 128),
                torch.tensor([41, 42]))
    padding = [0, 0, 1, -1] + [3] * 8
    assert graphs.inputs((4, 128)).tolist() == [[5, 10, 0, -1, 1] + [0] * 7, [6, 70, 2, 0, 1, 2, 3, 4, 5, 0, 0, 0],
                                          [7, 3, 1, 1] + [0] * 8, padding]
    assert graphs.inputs((8, 128))[4:].eq(99).all()  # rows beyond the bucket untouched
    assert graphs.prev_tokens[:2].tolist() == [41, 42]
