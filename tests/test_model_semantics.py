"""Engine-mode semantics of the V4.1 model on the embedded tiny checkpoint (and the golden one).

In the engine's CPU mode (``ModelOptions()``: batch-invariant GEMMs, packed attention lists, own
index keys) every row's result is a function of its sequence's tokens up to it only:

(a) chunked prefill == one prefill (logits, hidden rows and cache contents), bitwise;
(b) a mixed batch (new prefills, continuing chunks, decode tokens of several sequences with
    shuffled blocks and slots) == each sequence run alone, bitwise;
(c) a decode step == a fresh prefill of the same prefix, bitwise, far beyond the window and top-k;
(d) the official index-key hand-off (``official_index_handoff=True``) is the documented quirk:
    it changes layer 1's selection only on even decode steps with more than index_topk visible
    ratio-2 entries (and the logits from the first such change on); in reference mode it
    reproduces the golden decode steps bit for bit;
(e) on the golden checkpoint, default-mode decode == default-mode prefix prefill, bitwise.

The tiny model: window 16, compress ratios [0, 2, 2, 1, 1, 1] (layer 1 owns the ratio-2 keys,
layer 3 the ratio-1 keys and the candidate blocks), index_topk 8, Engram on layers 0 and 1.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.attention import ForwardState
from model.batch import ForwardBatch
from model.cache import V41Cache
from model.loader import load_model
from model.transformer import ModelOptions, V41Model

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW, TOPK = 16, 8
RATIO2_OWNER, RATIO1_OWNER = 1, 3


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: not bitwise equal (max abs {max_abs(a, b):g})"


def selected(state: ForwardState, layer: int, row: int) -> list[int]:
    """Entries selected for flat row ``row`` of the forward."""
    sel = state.selections[layer]
    return sel.entries[row, : int(sel.counts[row])].tolist()


@pytest.fixture(scope="module")
def tiny_model_seed1(tiny_checkpoint_seed1: Path, single_thread) -> V41Model:
    return load_model(tiny_checkpoint_seed1, ModelOptions())


@pytest.fixture(scope="module")
def tiny_official(tiny_checkpoint: Path, single_thread) -> V41Model:
    return load_model(tiny_checkpoint, ModelOptions(official_index_handoff=True))


@pytest.fixture(scope="module")
def golden(golden_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(golden_dir / "cases.safetensors"))


def test_tiny_checkpoint_has_the_layout_these_tests_assume(tiny_model: V41Model) -> None:
    cfg = tiny_model.cfg
    assert cfg.sliding_window == WINDOW and cfg.index_topk == TOPK
    assert cfg.compress_ratios == (0, 2, 2, 1, 1, 1)
    assert cfg.kv_source_layers == (RATIO2_OWNER, RATIO1_OWNER)
    assert cfg.candidate_source_layer_id == RATIO1_OWNER and cfg.engram_layer_ids == (0, 1)


# ----------------------------------------------------------------------------- (a) chunked prefill
def random_cuts(length: int, n_chunks: int, seed: int) -> list[int]:
    return sorted(random.Random(seed).sample(range(1, length), n_chunks - 1))


CHUNKINGS = [
    ("random-2", lambda n: random_cuts(n, 2, 1)),
    ("random-4", lambda n: random_cuts(n, 4, 2)),
    ("random-9", lambda n: random_cuts(n, 9, 3)),
    # odd/even cuts around group, window and candidate-block edges, with single-token chunks
    ("edges", lambda n: [1, 2, 3, 15, 16, 17, 31, 33, 48, n - 1]),
]


@pytest.mark.parametrize("checkpoint", ["seed0", "seed1"])
def test_chunked_prefill_equals_one_prefill(request, checkpoint: str, one_sequence, cache_snapshot,
                                            bitwise_mismatches, random_tokens) -> None:
    model = request.getfixturevalue("tiny_model" if checkpoint == "seed0" else "tiny_model_seed1")
    length = 71
    tokens = random_tokens(model.cfg.vocab_size, length, seed=100 if checkpoint == "seed0" else 101)
    whole = one_sequence(model, length)
    whole_hidden = whole.forward(tokens)
    whole_last = model.logits(whole_hidden[-1:])[0]
    whole_state = cache_snapshot(whole.cache, whole.slot, whole.block_table, length)
    assert whole_state["compressed_kv.layer1"].shape[0] == length // 2 > TOPK

    chunkings = CHUNKINGS if checkpoint == "seed0" else CHUNKINGS[1:3]
    for name, make_cuts in chunkings:
        cuts = [0, *make_cuts(length), length]
        seq = one_sequence(model, length, block_size=16)  # several blocks per sequence too
        hidden = torch.cat([seq.forward(tokens[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])
        assert_same(hidden, whole_hidden, f"{name} {cuts}: hidden rows")
        assert_same(model.logits(hidden[-1:])[0], whole_last, f"{name} {cuts}: last-token logits")
        bad = bitwise_mismatches(cache_snapshot(seq.cache, seq.slot, seq.block_table, length), whole_state)
        assert not bad, f"{name} {cuts}: cache differs in {bad}"


def test_chunked_prefill_leaves_the_same_open_group_tail(tiny_model: V41Model, one_sequence, cache_snapshot,
                                                         random_tokens) -> None:
    """An odd length leaves a ratio-2 group open: its pending row must be the same after any chunking
    (and is what the next token's group closes with)."""
    tokens = random_tokens(tiny_model.cfg.vocab_size, 23, seed=7)
    one = one_sequence(tiny_model, 24)
    one.forward(tokens)
    split = one_sequence(tiny_model, 24)
    for a, b in ((0, 10), (10, 11), (11, 23)):
        split.forward(tokens[a:b])
    s1 = cache_snapshot(one.cache, 0, one.block_table, 23)
    s2 = cache_snapshot(split.cache, 0, split.block_table, 23)
    assert s1["tail_kv.layer1"].shape[0] == 1
    assert_same(s2["tail_kv.layer1"], s1["tail_kv.layer1"], "open group kv")
    assert_same(s2["tail_score.layer1"], s1["tail_score.layer1"], "open group score")
    nxt = random_tokens(tiny_model.cfg.vocab_size, 1, seed=8)
    assert_same(split.logits(nxt), one.logits(nxt), "next token after the open group")


# ----------------------------------------------------------------------------- (b) mixed batches
class SharedCache:
    """Several sequences in one cache with shuffled, non-contiguous blocks and slots."""

    def __init__(self, model: V41Model, lengths: dict[str, int], block_size: int, seed: int):
        self.model = model
        rng = random.Random(seed)
        need = {name: -(-n // block_size) for name, n in lengths.items()}
        num_blocks = sum(need.values()) + 6  # spare blocks stay unused
        num_slots = len(lengths) + 3
        self.cache = V41Cache.allocate(model.cfg, num_blocks, num_slots, block_size=block_size)
        free_blocks = list(range(1, num_blocks))
        rng.shuffle(free_blocks)
        free_slots = list(range(num_slots))
        rng.shuffle(free_slots)
        self.tables = {name: [free_blocks.pop() for _ in range(n)] for name, n in need.items()}
        self.slots = {name: free_slots.pop() for name in lengths}
        self.unused_slots = free_slots
        self.length = {name: 0 for name in lengths}
        self.previous = {name: -1 for name in lengths}

    def step(self, work: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """One forward over all ``(sequence, tokens)``; logits of every row, per sequence."""
        names = [name for name, _ in work]
        batch = ForwardBatch.build([tokens for _, tokens in work], [self.length[n] for n in names],
                                   [self.slots[n] for n in names], [self.tables[n] for n in names],
                                   [self.previous[n] for n in names])
        hidden = self.model.forward(batch, self.cache)
        out = {}
        for b, (name, tokens) in enumerate(work):
            out[name] = self.model.logits(hidden[batch.rows(b)])
            self.previous[name], self.length[name] = self.length[name], self.length[name] + len(tokens)
        return out


# (sequence, number of tokens) per forward; the last forward mixes a new prefill (A, E), continuing
# chunks starting at odd and even positions (B at 19, F at 30) and decode tokens (C at 40, D at 67)
SCHEDULE = [
    [("B", 19), ("C", 39), ("D", 60), ("F", 17)],
    [("D", 7), ("C", 1), ("F", 13)],
    [("A", 23), ("F", 25), ("C", 1), ("E", 3), ("B", 14), ("D", 1)],
]


@pytest.mark.parametrize("official", [False, True], ids=["own-keys", "official-handoff"])
def test_mixed_batch_equals_each_sequence_alone(request, official: bool, one_sequence, cache_snapshot,
                                                bitwise_mismatches, random_tokens) -> None:
    model = request.getfixturevalue("tiny_official" if official else "tiny_model")
    vocab = model.cfg.vocab_size
    lengths: dict[str, int] = {}
    for forward in SCHEDULE:
        for name, n in forward:
            lengths[name] = lengths.get(name, 0) + n
    tokens = {name: random_tokens(vocab, n, seed=200 + i) for i, (name, n) in enumerate(sorted(lengths.items()))}

    shared = SharedCache(model, lengths, block_size=16, seed=5)
    assert any(t != list(range(t[0], t[0] + len(t))) for t in shared.tables.values() if len(t) > 1)
    assert sorted(shared.slots.values()) != list(range(len(lengths)))
    alone = {name: one_sequence(model, n) for name, n in lengths.items()}
    for step, forward in enumerate(SCHEDULE):
        work = [(name, tokens[name][shared.length[name]: shared.length[name] + n]) for name, n in forward]
        batched = shared.step(work)
        for name, chunk in work:
            expected = alone[name].logits(chunk, all_rows=True)
            assert_same(batched[name], expected, f"step {step}, sequence {name} ({len(chunk)} tokens)")
    for name, n in lengths.items():
        assert shared.length[name] == n
        bad = bitwise_mismatches(cache_snapshot(shared.cache, shared.slots[name], shared.tables[name], n),
                                 cache_snapshot(alone[name].cache, 0, alone[name].block_table, n))
        assert not bad, f"sequence {name}: cache differs in {bad}"
    # the block tables have no padding entries: nothing may land in block 0 or in slots no sequence holds
    # (a written row, zeros included, has a nonzero scale byte, so untouched rows are all-zero bytes)
    cache = shared.cache
    for layer in model.cfg.kv_source_layers:
        assert not cache.compressed_kv[layer].data[0].any() and not cache.index_keys[layer].data[0].any()
    for slot in shared.unused_slots:
        assert all(not cache.window[layer].data[slot].any() for layer in range(model.cfg.num_layers))
        assert not cache.engram_history[slot].any()


def test_batch_order_does_not_matter(tiny_model: V41Model, random_tokens) -> None:
    """The same three chunks in another order in the batch give the same rows."""
    vocab = tiny_model.cfg.vocab_size
    seqs = {"x": random_tokens(vocab, 30, 1), "y": random_tokens(vocab, 5, 2), "z": random_tokens(vocab, 44, 3)}
    results = []
    for order in (["x", "y", "z"], ["z", "x", "y"]):
        shared = SharedCache(tiny_model, {k: len(v) for k, v in seqs.items()}, block_size=32, seed=9)
        results.append(shared.step([(name, seqs[name]) for name in order]))
    for name in seqs:
        assert_same(results[0][name], results[1][name], f"sequence {name}")


def test_model_is_thread_count_independent(tiny_model: V41Model, one_sequence, random_tokens) -> None:
    """One prefill (window wrap-around, > index_topk entries of both ratios) with 2 threads == 1 thread."""
    tokens = random_tokens(tiny_model.cfg.vocab_size, 21, seed=17)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            rows.append(one_sequence(tiny_model, len(tokens)).logits(tokens, all_rows=True))
        finally:
            torch.set_num_threads(1)
    assert_same(rows[1], rows[0], "prefill rows, 2 vs 1 threads")


# ----------------------------------------------------------------------------- (c) decode == prefill
def test_decode_steps_equal_prefix_prefill(tiny_model: V41Model, run_sequence, one_sequence, random_tokens) -> None:
    """Prompt of 10, then one token per forward up to position 46: beyond 2 * window (32), beyond
    index_topk entries of both ratios (ratio 1 from 8, ratio 2 from 18) and candidate blocks (12)."""
    prompt_len, last = 10, 46
    tokens = random_tokens(tiny_model.cfg.vocab_size, last + 1, seed=300)
    run = run_sequence(tiny_model, tokens[:prompt_len], tokens[prompt_len:])
    # one full prefill gives the prefix-prefill logits of every position at once (engine mode) ...
    full = one_sequence(tiny_model, last + 1).logits(tokens, all_rows=True)
    assert_same(run.prefill, full[prompt_len - 1], "prompt logits")
    for i, p in enumerate(range(prompt_len, last + 1)):
        assert_same(run.steps[i], full[p], f"decode step at position {p} vs full-prefill row")
    # ... and a fresh prefill of the prefix, at positions around every boundary
    for p in (prompt_len, 16, 17, 18, 31, 32, 33, last):
        fresh = one_sequence(tiny_model, p + 1).logits(tokens[: p + 1])
        assert_same(run.steps[p - prompt_len], fresh, f"decode step at position {p} vs fresh prefix prefill")


def test_decode_from_a_one_token_prompt(tiny_model_seed1: V41Model, run_sequence, one_sequence,
                                        random_tokens) -> None:
    tokens = random_tokens(tiny_model_seed1.cfg.vocab_size, 30, seed=301)
    run = run_sequence(tiny_model_seed1, tokens[:1], tokens[1:])
    full = one_sequence(tiny_model_seed1, 30).logits(tokens, all_rows=True)
    assert_same(torch.cat([run.prefill[None], run.steps]), full, "decode steps vs prefill rows (seed 1)")


# ----------------------------------------------------------------------------- (d) official hand-off
def test_official_handoff_is_the_documented_quirk(tiny_official: V41Model, tiny_model: V41Model, run_sequence,
                                                  one_sequence, random_tokens) -> None:
    """Decode with the reference's hand-off: on even positions layer 1 (ratio-2 owner) closes no group
    and scores against layer 3's keys. Before more than index_topk ratio-2 entries are visible
    (position < 18) that cannot change anything; from there on it changes the selection on some
    even steps (and the logits, also of later steps through the caches); on odd steps layer 1 uses
    its own keys and selects what a prefill selects."""
    prompt_len, last = 9, 39
    tokens = random_tokens(tiny_official.cfg.vocab_size, last + 1, seed=400)
    run = run_sequence(tiny_official, tokens[:prompt_len], tokens[prompt_len:], capture_states=True)
    prefill_state = ForwardState()
    full = one_sequence(tiny_model, last + 1).logits(tokens, all_rows=True, state=prefill_state)

    changed_logits, changed_selection = [], []
    for i, p in enumerate(range(prompt_len, last + 1)):
        state = run.states[i + 1]
        closes_group = (p + 1) // 2 > p // 2
        key_layer = state.index_key_layer[RATIO2_OWNER][0]
        assert key_layer == (RATIO2_OWNER if closes_group else RATIO1_OWNER), f"position {p}: keys of {key_layer}"
        assert state.index_key_layer[5] == [RATIO1_OWNER] and state.index_key_layer[RATIO1_OWNER] == [RATIO1_OWNER]
        ours, prefills = selected(state, RATIO2_OWNER, 0), selected(prefill_state, RATIO2_OWNER, p)
        visible = (p + 1) // 2
        if closes_group:
            assert ours == prefills, f"position {p} closes a group: layer 1 must select as a prefill does"
        elif visible <= TOPK:
            assert ours == prefills == list(range(visible)), f"position {p}: every visible entry is selected"
        elif ours != prefills:
            changed_selection.append(p)
        if p < 2 * (TOPK + 1):
            assert_same(run.steps[i], full[p], f"position {p}: the quirk cannot matter yet")
        elif not torch.equal(run.steps[i], full[p]):
            changed_logits.append(p)
    assert changed_selection, "the stale keys never changed layer 1's selection: quirk not reproduced"
    assert all(p % 2 == 0 for p in changed_selection)
    assert changed_logits, "official hand-off decode equals prefill everywhere: quirk not reproduced"
    assert min(changed_logits) >= min(changed_selection), "logits changed before any selection did"
    # the first changed step really differs from a fresh prefill of its prefix
    p = min(changed_logits)
    fresh = one_sequence(tiny_official, p + 1).logits(tokens[: p + 1])
    assert_same(fresh, full[p], f"fresh official prefill at {p} (a prefill publishes its own keys)")
    assert not torch.equal(run.steps[p - prompt_len], fresh)


def test_official_handoff_reproduces_golden_decode_in_reference_mode(golden_dir: Path, golden, run_sequence,
                                                                     golden_platform) -> None:
    """d001 (prompt of 1 token, 24 steps, all tie-free): bitwise equal to the reference's step_logits
    (on the golden set's platform); with own keys instead, the steps where the quirk can change the
    selection differ."""
    prompt = golden["decode.d001.prompt_ids"].tolist()
    steps = golden["decode.d001.step_input_ids"].tolist()
    assert golden["decode.d001.step_start_pos"].tolist() == list(range(1, 25))
    assert bool(golden["decode.d001.step_tie_free"].all())
    official = load_model(golden_dir / "checkpoint",
                          ModelOptions(batch_invariant=False, official_index_handoff=True, reference_layout=True))
    run = run_sequence(official, prompt, steps)
    assert_same(run.prefill, golden["decode.d001.prefill_logits"], "d001 prefill")
    for i in range(len(steps)):
        assert_same(run.steps[i], golden["decode.d001.step_logits"][i], f"d001 step {i} (position {i + 1})")

    own_keys = load_model(golden_dir / "checkpoint", ModelOptions(batch_invariant=False, reference_layout=True))
    naive = run_sequence(own_keys, prompt, steps)
    can_change = golden["decode.d001.step_quirk_changes_selection_possible"]
    first = int(torch.nonzero(can_change)[0])
    assert_same(naive.steps[:first], run.steps[:first], "before the quirk can matter")
    assert not torch.equal(naive.steps[can_change], golden["decode.d001.step_logits"][can_change])


# ----------------------------------------------------------------------------- (e) golden, default mode
def test_default_mode_decode_equals_prefix_prefill_on_golden_d017(golden_dir: Path, golden, run_sequence,
                                                                   one_sequence) -> None:
    model = load_model(golden_dir / "checkpoint", ModelOptions())
    prompt = golden["decode.d017.prompt_ids"].tolist()
    steps = golden["decode.d017.step_input_ids"].tolist()
    assert golden["decode.d017.step_start_pos"].tolist() == list(range(17, 41))
    run = run_sequence(model, prompt, steps)
    sequence = prompt + steps
    # every step against the rows of one prefill of the whole sequence (== prefix prefills, below)
    full = one_sequence(model, len(sequence)).logits(sequence, all_rows=True)
    for i, p in enumerate(range(len(prompt), len(sequence))):
        assert_same(run.steps[i], full[p], f"d017 step {i} (position {p}) vs prefill row")
    # fresh prefills of the prefix: first step, the quirk region of the reference (even positions
    # from 18 with > 8 ratio-2 entries visible), past 2 * window, last step
    for p in (17, 18, 19, 26, 32, 33, 40):
        fresh = one_sequence(model, p + 1).logits(sequence[: p + 1])
        assert_same(run.steps[p - len(prompt)], fresh, f"d017 position {p} vs fresh prefix prefill")
    # engine mode is not the reference's arithmetic, but it is the same model: top-1 mostly agrees
    agree = (run.steps.argmax(-1) == golden["decode.d017.prefix_prefill_logits"].argmax(-1)).float().mean()
    assert agree >= 0.75
