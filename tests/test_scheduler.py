"""Scheduler unit tests with fake model outputs: no model, no device.

A ``FakeRunner`` plays the device. It executes every plan in submission order against a simulated
paged KV cache and state slots and checks what a real model would need: each input token is the
sequence's true token at that position (``prev_row`` inputs are resolved from the previous plan's
samples, as the GPU does), every earlier position of the sequence is in its blocks, written by the
same sequence and epoch, and its state slot holds exactly the positions before the chunk. Its
"model" samples ``fake_token(seq_id, position)``, a pure function, so a sequence recomputed after
preemption produces the same tokens, as the real sampler does (noise = f(seed, position)).

A ``Driver`` plays ``EngineCore.step``: with ``zos=True`` it plans step N+1 before applying step N.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from engine_core.protocol import RequestOutput, SampledToken, SamplingParams, StepPlan, StepResult, TokenLogprob
from engine_core.scheduler import Scheduler, SchedulerConfig
from engine_core.sequence import Sequence, SequenceStatus

EOS = 1
STOP = 2  # used as a stop_token_id in the tests
VOCAB = 1000


def fake_token(seq_id: int, position: int) -> int:
    """The fake model's sample at ``position`` (the token after position - 1): never EOS nor STOP."""
    return 10 + (seq_id * 7919 + position * 104729) % (VOCAB - 10)


def make_scheduler(**overrides) -> Scheduler:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, num_state_slots=8, block_size=4,
                  max_model_len=512, eos_token_id=EOS)
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def make_seq(seq_id: int, prompt_len: int, arrival: float | None = None, **params) -> Sequence:
    prompt = [10 + (seq_id * 31 + i * 17) % (VOCAB - 10) for i in range(prompt_len)]
    params.setdefault("max_tokens", 8)
    return Sequence(seq_id, f"req-{seq_id}", prompt, SamplingParams(**params), seed=1000 + seq_id,
                    arrival_time=float(seq_id) if arrival is None else arrival)


def sample_results(plan: StepPlan, token: int | dict[int, int] | None = None, epoch_delta: int = 0) -> list[StepResult]:
    """Hand-made results: one SampledToken per sampling row (``token`` for all, or per seq_id)."""
    results = []
    for r, batch in enumerate(plan.ranks):
        tokens = []
        for step in batch.sequences:
            if step.sample:
                if token is None:
                    tok = fake_token(step.seq_id, step.start + len(step.token_ids))
                else:
                    tok = token[step.seq_id] if isinstance(token, dict) else token
                tokens.append(SampledToken(step.seq_id, step.epoch + epoch_delta, tok))
        results.append(StepResult(plan.step_id, r, tokens))
    return results


def rows(plan: StepPlan, rank: int = 0):
    return plan.ranks[rank].sequences


# ----------------------------------------------------------------------------- the fake device
class FakeRunner:
    def __init__(self, scheduler: Scheduler, token_fn=fake_token):
        cfg = scheduler.config
        self.block_size, self.token_fn = cfg.block_size, token_fn
        self.prompts: dict[int, list[int]] = {}
        self.kv = [dict() for _ in range(cfg.dp_size)]  # (block, offset) -> (seq_id, epoch, position, token)
        self.slot_state = [dict() for _ in range(cfg.dp_size)]  # slot -> (seq_id, epoch, next position)
        self.last_sampled: list[list[int]] = [[] for _ in range(cfg.dp_size)]
        self.sampled_at: dict[tuple[int, int], int] = {}  # (seq_id, position) -> token sampled there

    def register(self, seq: Sequence) -> None:
        self.prompts[seq.seq_id] = list(seq.prompt_token_ids)

    def sample(self, step) -> int:
        tok = self.token_fn(step.seq_id, step.start + len(step.token_ids))
        if tok in step.suppress_token_ids:
            tok = 500 + tok  # what a real sampler does: something else (never a stop token here)
        return tok

    def true_token(self, seq_id: int, position: int) -> int:
        prompt = self.prompts[seq_id]
        if position < len(prompt):
            return prompt[position]
        return self.sampled_at[(seq_id, position)]  # an output: what this runner sampled there

    def execute(self, plan: StepPlan) -> list[StepResult]:
        bs = self.block_size
        results = []
        for r, batch in enumerate(plan.ranks):
            kv, slots = self.kv[r], self.slot_state[r]
            sampled_rows = [-1] * len(batch.sequences)
            tokens = []
            seen = set()
            for i, step in enumerate(batch.sequences):
                assert step.seq_id not in seen, "a sequence twice in one step"
                seen.add(step.seq_id)
                n = len(step.token_ids)
                assert n >= 1
                ids = list(step.token_ids)
                if step.prev_row >= 0:
                    assert ids == [-1], "a prev_row input must be the single placeholder -1"
                    ids = [self.last_sampled[r][step.prev_row]]
                    assert ids[0] >= 0, f"prev_row {step.prev_row} points at a row that sampled nothing"
                else:
                    assert -1 not in ids, "placeholder -1 without prev_row"
                for k, tok in enumerate(ids):
                    assert tok == self.true_token(step.seq_id, step.start + k), \
                        f"seq {step.seq_id}: wrong input token at position {step.start + k}"
                end = step.start + n
                table = step.block_table
                assert 0 not in table and len(set(table)) == len(table), f"bad block table {table}"
                assert len(table) * bs >= end, "block table does not cover the chunk"
                for p in range(step.start):  # what attention reads
                    assert kv.get((table[p // bs], p % bs)) == (step.seq_id, step.epoch, p,
                                                                 self.true_token(step.seq_id, p)), \
                        f"seq {step.seq_id} epoch {step.epoch}: position {p} not in its cache"
                if step.start > 0:  # sliding window / compressor tail
                    assert slots.get(step.slot) == (step.seq_id, step.epoch, step.start), \
                        f"seq {step.seq_id}: state slot {step.slot} holds {slots.get(step.slot)}"
                for k, tok in enumerate(ids):
                    p = step.start + k
                    kv[(table[p // bs], p % bs)] = (step.seq_id, step.epoch, p, tok)
                slots[step.slot] = (step.seq_id, step.epoch, end)
                targets = step.prompt_logprob_targets
                if targets:
                    prompt_len = len(self.prompts[step.seq_id])
                    assert step.start + len(targets) <= prompt_len - 1
                    assert targets == [self.true_token(step.seq_id, step.start + 1 + j) for j in range(len(targets))]
                tok = -1
                if step.sample:
                    assert step.params is not None
                    tok = self.sample(step)
                    prior = self.sampled_at.setdefault((step.seq_id, end), tok)
                    assert prior == tok, "a recomputed sequence must sample the same token"
                    sampled_rows[i] = tok
                if step.sample or targets:
                    plp = [TokenLogprob(t, -0.5) for t in targets] or None
                    tokens.append(SampledToken(step.seq_id, step.epoch, tok, None, plp))
            self.last_sampled[r] = sampled_rows
            results.append(StepResult(plan.step_id, r, tokens))
        return results


class Driver:
    """``EngineCore.step`` without a model: plan, 'launch' on the FakeRunner, apply the previous step."""

    def __init__(self, scheduler: Scheduler, zos: bool = True, token_fn=fake_token):
        self.sched, self.zos = scheduler, zos
        self.runner = FakeRunner(scheduler, token_fn)
        self.in_flight: list[StepResult] | None = None
        self.outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        self.plans: list[StepPlan] = []
        self.preempted: list[tuple[int, list[tuple[int, int]]]] = []  # (victim, [(seq_id, outputs)] running)
        self.sampled_epochs: set[tuple[int, int]] = set()
        self.seqs: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> Sequence:
        self.runner.register(seq)
        self.sched.add(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def step(self) -> StepPlan | None:
        sched = self.sched
        before = {s.seq_id: (s.num_cached_tokens, s.num_tokens, s.num_inflight_tokens, s.epoch)
                  for s in sched.live.values()}
        running_before = [(s.seq_id, s.num_outputs_expected) for r in sched.ranks for s in r.running]
        previous = self.plans[-1] if self.plans else None
        plan = sched.schedule()
        for seq_id, (_, _, _, epoch) in before.items():
            seq = self.seqs[seq_id]
            if seq.epoch != epoch:
                self.preempted.append((seq_id, running_before))
        if plan is not None:
            self._check_plan(plan, before, previous)
            self.plans.append(plan)
        results = self.runner.execute(plan) if plan is not None else None
        if self.zos:
            apply, self.in_flight = self.in_flight, results
        else:
            apply = results
        if apply is not None:
            for out in sched.update(apply):
                self.outputs[out.request_id].append(out)
        if plan is None and apply is None and sched.has_work:
            raise AssertionError(f"scheduler stalled with work left: {sched.stats()}")
        return plan

    def _check_plan(self, plan: StepPlan, before: dict, previous: StepPlan | None) -> None:
        for r, batch in enumerate(plan.ranks):
            for i, step in enumerate(batch.sequences):
                cached, ntok, inflight, epoch = before[step.seq_id]
                assert self.seqs[step.seq_id].dp_rank == r
                if step.epoch == epoch:
                    assert step.start == cached, "a chunk must start where the cache ends"
                else:  # preempted and re-admitted within this very schedule() call
                    assert step.epoch > epoch and step.start == 0
                    cached, inflight = 0, 0
                if not plan.is_prefill:
                    assert len(step.token_ids) == 1 and step.sample
                    # the decode advance rule
                    assert cached == ntok + inflight - 1, (cached, ntok, inflight)
                    if inflight:
                        assert step.token_ids == [-1]
                        prev_rows = [j for j, s in enumerate(previous.ranks[r].sequences)
                                     if s.seq_id == step.seq_id and s.sample]
                        assert prev_rows == [step.prev_row]
                    else:
                        assert step.prev_row == -1 and step.token_ids != [-1]
                else:
                    assert step.prev_row == -1
                # a prefill step holds only (re)prefill chunks, a decode step only sequences that sampled
                assert ((step.seq_id, step.epoch) in self.sampled_epochs) == (not plan.is_prefill), \
                    f"step {plan.step_id}: seq {step.seq_id} in a {'prefill' if plan.is_prefill else 'decode'} step"
            for step in batch.sequences:
                if step.sample:
                    self.sampled_epochs.add((step.seq_id, step.epoch))
            if plan.is_prefill:
                assert sum(len(s.token_ids) for s in batch.sequences) <= self.sched.config.max_num_batched_tokens

    def drain(self) -> None:
        if self.in_flight is not None:
            apply, self.in_flight = self.in_flight, None
            for out in self.sched.update(apply):
                self.outputs[out.request_id].append(out)

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_work or self.in_flight is not None:
            self.step()
            steps += 1
            assert steps <= max_steps, f"no progress after {max_steps} steps: {self.sched.stats()}"
        return steps

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    def finish_reason(self, request_id: str) -> str | None:
        reasons = [out.finish_reason for out in self.outputs[request_id] if out.finish_reason]
        assert len(reasons) <= 1
        return reasons[0] if reasons else None


def expected_outputs(seq: Sequence, max_model_len: int, token_fn=fake_token, eos: int = EOS) -> tuple[list[int], str]:
    """What a sequence must produce with the fake model (suppression: the first min_tokens samples)."""
    p = seq.params
    out: list[int] = []
    if p.max_tokens == 0:
        return [], "length"
    while True:
        pos = seq.num_prompt_tokens + len(out)
        tok = token_fn(seq.seq_id, pos)
        stops = tok in p.stop_token_ids or (tok == eos and not p.ignore_eos)
        if stops and len(out) < p.min_tokens:
            tok, stops = 500 + tok, False
        out.append(tok)
        if stops:
            return out, "stop"
        if len(out) >= p.max_tokens or pos + 1 >= max_model_len:
            return out, "length"


def check_invariants(sched: Scheduler) -> None:
    """No block or slot owned twice, pool counts agree with the sequences, block 0 never handed out."""
    for r, rank in enumerate(sched.ranks):
        held_blocks = [b for s in rank.running for b in s.block_table]
        held_slots = [s.slot for s in rank.running]
        assert 0 not in held_blocks
        assert len(set(held_blocks)) == len(held_blocks), "a block owned twice"
        assert None not in held_slots and len(set(held_slots)) == len(held_slots), "a slot owned twice"
        assert rank.blocks.num_used == len(held_blocks)
        assert rank.slots.num_used == len(held_slots)
        assert len(rank.running) <= sched.config.max_num_seqs
        for pool, held in ((rank.blocks, set(held_blocks)), (rank.slots, set(held_slots))):
            free = list(pool._free)
            assert len(set(free)) == len(free) and not set(free) & held
            assert all(pool._refcount[i] == (1 if i in held else 0) for i in range(len(pool._refcount)))
        assert rank.blocks._refcount[0] == 0 and 0 not in rank.blocks._free
        for s in rank.running:
            assert s.status is SequenceStatus.RUNNING and s.dp_rank == r
            assert len(s.block_table) * sched.config.block_size >= s.num_cached_tokens
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table and s.slot is None
        assert s.num_cached_tokens == 0 and s.num_inflight_tokens == 0
    running = [s for rank in sched.ranks for s in rank.running]
    assert {s.seq_id for s in running} | {s.seq_id for s in sched.waiting} == set(sched.live)
    assert len(running) + len(sched.waiting) == len(sched.live) == len(sched.by_request)
    stats = sched.stats()
    assert stats.kv_blocks_used == sum(len(s.block_table) for s in running)
    assert stats.state_slots_used == len(running) and stats.running == len(running)
    assert stats.waiting == len(sched.waiting)


def assert_all_free(sched: Scheduler) -> None:
    stats = sched.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0, stats
    assert stats.running == 0 and stats.waiting == 0 and not sched.has_work
    for rank in sched.ranks:
        assert rank.blocks.num_free == rank.blocks.capacity and rank.slots.num_free == rank.slots.capacity
        assert not any(rank.blocks._refcount) and not any(rank.slots._refcount)


# ============================================================================= chunked prefill
def test_chunks_are_contiguous_cover_the_prompt_and_only_the_last_samples():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    d = Driver(sched)
    seq = d.add(make_seq(0, 21))
    chunks = []
    while seq.num_cached_tokens < seq.num_prompt_tokens:
        plan = d.step()
        assert plan.is_prefill
        (step,) = rows(plan)
        chunks.append(step)
    assert [(c.start, len(c.token_ids)) for c in chunks] == [(0, 8), (8, 8), (16, 5)]
    assert [t for c in chunks for t in c.token_ids] == seq.prompt_token_ids
    assert [c.sample for c in chunks] == [False, False, True]
    assert [len(c.block_table) for c in chunks] == [2, 4, 6]  # blocks allocated as positions are planned
    assert chunks[1].block_table[:2] == chunks[0].block_table
    assert [c.previous_start for c in chunks] == [-1, 0, 8]
    assert sched.stats().kv_blocks_used == 6
    # the next step is a decode step of the sampled token, still in flight (ZOS)
    plan = d.step()
    assert not plan.is_prefill and rows(plan)[0].start == 21 and rows(plan)[0].token_ids == [-1]
    d.run()
    assert d.tokens("req-0") == expected_outputs(seq, 512)[0]
    assert_all_free(sched)


def test_budget_is_shared_oldest_first_and_new_prompts_fill_the_rest():
    sched = make_scheduler(max_num_batched_tokens=10, block_size=4)
    d = Driver(sched)
    a, b, c = d.add(make_seq(0, 7)), d.add(make_seq(1, 9)), d.add(make_seq(2, 3))
    p1 = d.step()
    assert [(s.seq_id, s.start, len(s.token_ids), s.sample) for s in rows(p1)] == [(0, 0, 7, True), (1, 0, 3, False)]
    assert c.status is SequenceStatus.WAITING  # budget spent: FIFO, no admission this step
    p2 = d.step()  # b continues first, then c is admitted with what is left
    assert p2.is_prefill
    assert [(s.seq_id, s.start, len(s.token_ids), s.sample) for s in rows(p2)] == [(1, 3, 6, True), (2, 0, 3, True)]
    p3 = d.step()  # no prefill left: one decode step for all three (a's token known, b's and c's in flight)
    assert not p3.is_prefill
    assert [(s.seq_id, s.token_ids == [-1], s.prev_row) for s in rows(p3)] == [(0, False, -1), (1, True, 0), (2, True, 1)]
    d.run()
    for s in (a, b, c):
        assert d.tokens(s.request_id) == expected_outputs(s, 512)[0]
    assert_all_free(sched)


@pytest.mark.parametrize("zos", [True, False])
def test_chunked_and_unchunked_give_the_same_tokens(zos):
    outs = {}
    for budget in (3, 5, 512):
        sched = make_scheduler(max_num_batched_tokens=budget)
        d = Driver(sched, zos=zos)
        seqs = [d.add(make_seq(i, n, max_tokens=6)) for i, n in enumerate([13, 1, 7, 22])]
        d.run()
        outs[budget] = [d.tokens(s.request_id) for s in seqs]
        assert outs[budget] == [expected_outputs(s, 512)[0] for s in seqs]
        assert_all_free(sched)
    assert outs[3] == outs[5] == outs[512]


@pytest.mark.parametrize("zos", [False, True])
def test_a_step_is_prefill_or_decode_never_both(zos):
    sched = make_scheduler(max_num_batched_tokens=6)
    d = Driver(sched, zos=zos)
    d.add(make_seq(0, 5, max_tokens=12))
    for _ in range(4):
        d.step()
    d.add(make_seq(1, 20, max_tokens=4))  # arrives while seq 0 decodes: 4 prefill chunks
    d.run()  # the Driver checks every plan: prefill rows never sampled before, decode rows all did
    chunk_plans = [p for p in d.plans if any(s.seq_id == 1 and not s.sample for s in rows(p))]
    assert len(chunk_plans) == 3 and all(p.is_prefill and len(rows(p)) == 1 for p in chunk_plans)
    assert sum(not p.is_prefill and {s.seq_id for s in rows(p)} == {0, 1} for p in d.plans) >= 3


# ============================================================================= decode advance rule / ZOS
def test_zos_decode_input_in_flight_is_a_prev_row_reference_and_capacity_is_reserved():
    sched = make_scheduler(block_size=4)
    a, b = make_seq(0, 6, max_tokens=4), make_seq(1, 8, max_tokens=4)
    sched.add(a)
    sched.add(b)
    prefill = sched.schedule()
    assert [s.seq_id for s in rows(prefill)] == [0, 1] and all(s.sample for s in rows(prefill))
    assert a.num_inflight_tokens == b.num_inflight_tokens == 1
    used = sched.stats().kv_blocks_used
    assert used == 2 + 2
    # step N+1 planned before step N's tokens are known
    decode = sched.schedule()
    assert not decode.is_prefill
    by_id = {s.seq_id: s for s in rows(decode)}
    assert by_id[0].token_ids == [-1] and by_id[0].prev_row == 0 and by_id[0].start == 6
    assert by_id[1].token_ids == [-1] and by_id[1].prev_row == 1 and by_id[1].start == 8
    # position 8 of b opens a third block: reserved now, before its token exists
    assert len(by_id[1].block_table) == 3 and len(by_id[0].block_table) == 2
    assert sched.stats().kv_blocks_used == used + 1
    assert a.num_cached_tokens == 7 and a.num_inflight_tokens == 2 and a.num_tokens == 6
    # step N's tokens arrive
    outs = sched.update(sample_results(prefill, {0: 100, 1: 200}))
    assert {o.request_id: o.new_token_ids for o in outs} == {"req-0": [100], "req-1": [200]}
    assert a.num_inflight_tokens == 1 and a.num_tokens == 7
    # N+2: the rows of N+1 are referenced (order of the previous plan, not seq ids)
    nxt = sched.schedule()
    assert {s.seq_id: s.prev_row for s in rows(nxt)} == {s.seq_id: i for i, s in enumerate(rows(decode))}
    assert all(s.token_ids == [-1] for s in rows(nxt))


def test_no_decode_while_prefilling_or_when_last_token_is_in_flight():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = Driver(sched)
    a = d.add(make_seq(0, 10, max_tokens=2))
    p = d.step()
    assert p.is_prefill and a.is_prefilling
    p = d.step()
    assert p.is_prefill and rows(p)[0].start == 4
    p = d.step()  # last chunk [8, 10) samples output 1
    assert p.is_prefill and rows(p)[0].sample
    p = d.step()  # output 2 (the last one) is planned with output 1 still in flight
    assert not p.is_prefill and rows(p)[0].token_ids == [-1]
    assert a.num_outputs_expected == 2
    # max_tokens outputs are expected: nothing more is planned although the cache could take it
    assert d.step() is None
    assert a.num_cached_tokens == 11
    d.run()
    assert d.finish_reason("req-0") == "length" and len(d.tokens("req-0")) == 2


def test_sequence_finishing_on_a_token_in_flight_drops_the_speculative_step():
    sched = make_scheduler()
    a = make_seq(0, 4, max_tokens=10)
    sched.add(a)
    prefill = sched.schedule()
    decode = sched.schedule()  # planned on the assumption that a goes on
    outs = sched.update(sample_results(prefill, EOS))
    assert outs[0].finish_reason == "stop" and outs[0].stop_token_id == EOS and outs[0].new_token_ids == [EOS]
    assert_all_free(sched)  # blocks reserved for the speculative step come back at once
    assert sched.update(sample_results(decode, 77)) == []  # its result is dropped
    assert a.output_token_ids == [EOS]
    assert sched.schedule() is None


# ============================================================================= preemption
def _lockstep_setup():
    """a, b, c admitted in one step (so they decode in lockstep under ZOS); 6 usable blocks of 4 tokens.

    Prompts 3, 4, 4: b and c open their second block at their first decode, a at its second; at
    the fifth decode b needs a third block and none is free. A fourth request waits (max_num_seqs).
    """
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
    d = Driver(sched)
    a, b, c = (d.add(make_seq(i, n, max_tokens=20)) for i, n in enumerate([3, 4, 4]))
    late = d.add(make_seq(3, 2, max_tokens=3))
    return sched, d, a, b, c, late


def test_preemption_frees_blocks_and_slot_bumps_epoch_and_requeues_at_the_front():
    sched, d, a, b, c, late = _lockstep_setup()
    while not d.preempted:
        plan = d.step()
        check_invariants(sched)
    assert not plan.is_prefill and len(d.plans) == 6  # prefill + the fifth decode step
    victim, running = d.preempted[0]
    # equal outputs: the tie goes to the latest arrival (c), although b is the one that needed a block
    assert victim == 2 and sorted(running) == [(0, 5), (1, 5), (2, 5)]
    assert {s.seq_id for s in rows(plan)} == {0, 1}
    assert sched.num_preemptions == 1 and sched.stats().preemptions == 1
    assert c.status is SequenceStatus.WAITING and list(sched.waiting) == [c, late]
    assert c.block_table == [] and c.slot is None and c.epoch == 1
    assert c.num_cached_tokens == 0 and c.num_inflight_tokens == 0
    assert sched.stats().kv_blocks_used == 6 - 2 + 1 and sched.stats().state_slots_used == 2  # c gave 2, b took 1


def test_preempted_sequence_is_recomputed_from_position_0_with_its_outputs():
    sched, d, a, b, c, late = _lockstep_setup()
    while not d.preempted:
        d.step()
    d.drain()  # c's token of the in-flight step is dropped (older epoch)
    known = list(c.prompt_token_ids) + list(c.output_token_ids)
    assert len(c.output_token_ids) == 4
    while True:
        plan = d.step()
        mine = [s for s in rows(plan) if s.seq_id == 2] if plan else []
        if mine:
            break
        assert late.status is SequenceStatus.WAITING  # FIFO behind c
    (step,) = mine
    assert plan.is_prefill and step.start == 0 and step.epoch == 1 and step.sample
    assert step.token_ids == known and step.num_prompt_tokens == 4
    assert step.previous_start == -1
    d.run()
    for s in (a, b, c, late):
        assert (d.tokens(s.request_id), d.finish_reason(s.request_id)) == expected_outputs(s, 512), s.request_id
    assert_all_free(sched)


def test_preemption_victim_is_the_running_sequence_with_the_longest_output():
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    d = Driver(sched)
    d.add(make_seq(0, 3, max_tokens=30))
    for _ in range(4):
        d.step()
    d.add(make_seq(1, 4, max_tokens=30))
    d.add(make_seq(2, 4, max_tokens=30))
    while not d.preempted:
        d.step()
    victim, running = d.preempted[0]
    outputs = dict(running)
    assert victim == 0 and outputs[0] > max(outputs[1], outputs[2])  # strictly the longest, not a tie
    assert not d.plans[-1].is_prefill and 0 not in {s.seq_id for s in rows(d.plans[-1])}


def test_after_a_prefill_step_all_running_sequences_decode_in_every_step():
    sched = make_scheduler()
    d = Driver(sched)
    d.add(make_seq(0, 4, max_tokens=30))
    for _ in range(3):
        d.step()
    d.add(make_seq(1, 4, max_tokens=10))
    admitted = d.step()
    assert [s.seq_id for s in rows(admitted)] == [1]
    following = [d.step() for _ in range(8)]
    assert all({s.seq_id for s in rows(p)} == {0, 1} for p in following), \
        [sorted(s.seq_id for s in rows(p)) for p in following]


def test_results_of_an_older_epoch_are_dropped():
    sched = make_scheduler()
    a = make_seq(0, 5, max_tokens=5)
    sched.add(a)
    plan = sched.schedule()
    sched._preempt(a)  # as the scheduler does when blocks run out
    assert a.epoch == 1
    assert sched.update(sample_results(plan, 42)) == []
    assert a.output_token_ids == [] and a.num_inflight_tokens == 0
    again = sched.schedule()
    assert rows(again)[0].epoch == 1 and rows(again)[0].start == 0
    # a forged result with a newer epoch is not applied either
    assert sched.update(sample_results(again, 42, epoch_delta=1)) == []
    outs = sched.update(sample_results(again, 42))
    assert outs[0].new_token_ids == [42]


def test_results_for_aborted_or_finished_or_unknown_sequences_are_dropped():
    sched = make_scheduler()
    a, b = make_seq(0, 5, max_tokens=1), make_seq(1, 5)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.abort("req-1")
    outs = sched.update(sample_results(plan, 42))
    assert [o.request_id for o in outs] == ["req-0"] and outs[0].finish_reason == "length"
    assert sched.update(sample_results(plan, 43)) == []  # a is finished
    assert sched.update([StepResult(99, 0, [SampledToken(12345, 0, 7)])]) == []
    assert a.output_token_ids == [42] and b.output_token_ids == []
    assert_all_free(sched)


def test_decode_preemption_under_zos_and_without_zos_gives_the_same_tokens():
    for zos in (True, False):
        sched = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=6)
        d = Driver(sched, zos=zos)
        seqs = [d.add(make_seq(i, 3 + i, max_tokens=12)) for i in range(5)]
        d.run()
        assert sched.num_preemptions > 0
        for s in seqs:
            assert d.tokens(s.request_id) == expected_outputs(s, 512)[0]
        assert_all_free(sched)


@pytest.mark.parametrize("zos", [True, False])
def test_sequence_longer_than_kv_capacity_finishes_instead_of_stalling(zos):
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=100)  # 8 tokens of KV per rank
    d = Driver(sched, zos=zos)
    d.add(make_seq(0, 5, max_tokens=10))
    d.run(max_steps=50)
    assert d.finish_reason("req-0") == "length"
    # it fills the 8 cached positions: 3 outputs (8 tokens), or 4 if the last, never-written token counts
    assert len(d.tokens("req-0")) in (3, 4)
    assert_all_free(sched)


# ============================================================================= admission
def test_admission_respects_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, num_state_slots=8)
    d = Driver(sched)
    seqs = [d.add(make_seq(i, 4, max_tokens=3)) for i in range(3)]
    plan = d.step()
    assert [s.seq_id for s in rows(plan)] == [0, 1] and seqs[2].status is SequenceStatus.WAITING
    while seqs[2].status is SequenceStatus.WAITING:
        assert sched.stats().running <= 2
        d.step()
    assert seqs[0].is_finished or seqs[1].is_finished
    d.run()
    assert_all_free(sched)


def test_admission_respects_state_slots():
    sched = make_scheduler(max_num_seqs=8, num_state_slots=2)
    d = Driver(sched)
    seqs = [d.add(make_seq(i, 4, max_tokens=3)) for i in range(3)]
    plan = d.step()
    assert [s.seq_id for s in rows(plan)] == [0, 1]
    assert {s.slot for s in rows(plan)} == {0, 1}
    assert sched.stats().state_slots_used == 2 and seqs[2].status is SequenceStatus.WAITING
    d.run()
    assert all(d.finish_reason(s.request_id) == "length" for s in seqs)
    assert_all_free(sched)


def test_admission_is_fifo_head_of_line_on_blocks():
    # 4 usable blocks; a holds 3; b's first chunk needs 2 -> b waits and c (1 block) may not jump it
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=8)
    d = Driver(sched)
    a = d.add(make_seq(0, 12, max_tokens=1))
    d.step()
    d.step()
    assert len(a.block_table) == 3
    b, c = d.add(make_seq(1, 8, max_tokens=1)), d.add(make_seq(2, 2, max_tokens=1))
    plan = d.step()
    assert plan is None or all(s.seq_id == 0 for s in rows(plan))
    assert b.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b, c]
    d.run()
    assert [d.finish_reason(s.request_id) for s in (a, b, c)] == ["length"] * 3
    assert_all_free(sched)


def test_dp_ranks_get_their_own_pools_and_sequences():
    sched = make_scheduler(dp_size=2, num_blocks=9, max_num_seqs=2)
    d = Driver(sched)
    seqs = [d.add(make_seq(i, 5 + i, max_tokens=5)) for i in range(4)]
    plan = d.step()
    assert len(plan.ranks) == 2
    assert sorted(len(b.sequences) for b in plan.ranks) == [2, 2]
    check_invariants(sched)
    d.run()
    for s in seqs:
        assert d.tokens(s.request_id) == expected_outputs(s, 512)[0]
    assert_all_free(sched)


# ============================================================================= finish conditions
def _run_one(prompt_len=4, token_fn=fake_token, zos=True, **params):
    sched = make_scheduler(max_model_len=params.pop("max_model_len", 512))
    d = Driver(sched, zos=zos, token_fn=token_fn)
    seq = d.add(make_seq(0, prompt_len, **params))
    d.run()
    assert_all_free(sched)
    return d, seq


def _emit_at(outputs: dict[int, int]):
    """A fake model that emits ``outputs[k]`` as its k-th output (1-based) for a 4-token prompt."""
    return lambda seq_id, pos: outputs.get(pos - 4 + 1, fake_token(seq_id, pos))


@pytest.mark.parametrize("zos", [True, False])
def test_eos_stops_and_is_reported(zos):
    d, seq = _run_one(token_fn=_emit_at({3: EOS}), zos=zos, max_tokens=10)
    assert d.finish_reason("req-0") == "stop"
    assert d.tokens("req-0")[-1] == EOS and len(d.tokens("req-0")) == 3
    assert d.outputs["req-0"][-1].stop_token_id == EOS


def test_stop_token_ids_stop():
    d, _ = _run_one(token_fn=_emit_at({2: STOP, 4: EOS}), max_tokens=10, stop_token_ids=(STOP,))
    assert d.finish_reason("req-0") == "stop" and d.outputs["req-0"][-1].stop_token_id == STOP
    assert len(d.tokens("req-0")) == 2


def test_max_tokens_stops_with_length():
    d, _ = _run_one(max_tokens=5)
    assert d.finish_reason("req-0") == "length" and len(d.tokens("req-0")) == 5
    assert d.outputs["req-0"][-1].stop_token_id is None


def test_max_model_len_stops_with_length():
    d, _ = _run_one(prompt_len=6, max_tokens=100, max_model_len=10)
    assert d.finish_reason("req-0") == "length" and len(d.tokens("req-0")) == 4


def test_ignore_eos_goes_on_to_max_tokens():
    d, _ = _run_one(token_fn=_emit_at({2: EOS, 3: EOS}), max_tokens=6, ignore_eos=True)
    assert d.finish_reason("req-0") == "length"
    assert d.tokens("req-0")[1:3] == [EOS, EOS] and len(d.tokens("req-0")) == 6


def test_ignore_eos_still_honours_stop_token_ids():
    d, _ = _run_one(token_fn=_emit_at({2: EOS, 4: STOP}), max_tokens=9, ignore_eos=True, stop_token_ids=(STOP,))
    assert d.finish_reason("req-0") == "stop" and len(d.tokens("req-0")) == 4


@pytest.mark.parametrize("zos", [True, False])
def test_min_tokens_suppresses_stop_tokens_in_the_plan(zos):
    sched = make_scheduler()
    d = Driver(sched, zos=zos, token_fn=_emit_at({k: EOS for k in range(1, 20)}))
    d.add(make_seq(0, 4, max_tokens=10, min_tokens=3, stop_token_ids=(STOP, 7)))
    d.run()
    sampling = [s for p in d.plans for s in rows(p) if s.sample]
    # ZOS plans one more (speculative) step, dropped when the stop token arrives
    assert len(sampling) == (5 if zos else 4)
    assert [sorted(s.suppress_token_ids) for s in sampling[:4]] == [[EOS, STOP, 7]] * 3 + [[]]
    assert all(not s.suppress_token_ids for s in sampling[3:])
    assert d.tokens("req-0")[:3] == [500 + EOS] * 3  # the fake sampler honours the suppression
    assert d.tokens("req-0")[3] == EOS and d.finish_reason("req-0") == "stop"


def test_min_tokens_with_ignore_eos_suppresses_only_stop_token_ids():
    sched = make_scheduler()
    d = Driver(sched)
    d.add(make_seq(0, 4, max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=(STOP,)))
    d.run()
    sampling = [s for p in d.plans for s in rows(p) if s.sample]
    assert [s.suppress_token_ids for s in sampling] == [[STOP], [STOP], [], []]


def test_min_tokens_suppression_survives_preemption():
    sched = make_scheduler()
    d = Driver(sched, zos=False)
    a = d.add(make_seq(0, 4, max_tokens=6, min_tokens=4, stop_token_ids=(STOP,)))
    d.step()
    d.step()
    sched._preempt(a)
    d.run()
    sampling = [(s.start + len(s.token_ids), s.suppress_token_ids) for p in d.plans for s in rows(p) if s.sample]
    # the sample at position 4 + k - 1 is output k: suppressed for k <= 4 whatever epoch
    assert all(bool(sup) == (pos - 4 < 4) for pos, sup in sampling), sampling


@pytest.mark.parametrize("zos", [True, False])
def test_max_tokens_zero_finishes_after_the_prefill_without_tokens(zos):
    d, seq = _run_one(zos=zos, max_tokens=0)
    assert d.finish_reason("req-0") == "length" and d.tokens("req-0") == []
    assert len(d.plans) == 1 and d.plans[0].is_prefill


def test_max_tokens_zero_with_prompt_logprobs():
    d, seq = _run_one(prompt_len=9, max_tokens=0, prompt_logprobs=0)
    out = [o for o in d.outputs["req-0"] if o.prompt_logprobs is not None]
    assert len(out) == 1 and [lp.token_id for lp in out[0].prompt_logprobs] == seq.prompt_token_ids[1:]
    assert d.finish_reason("req-0") == "length" and d.tokens("req-0") == []


# ============================================================================= abort
def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    d = Driver(sched)
    d.add(make_seq(0, 4))
    b = d.add(make_seq(1, 4))
    d.step()
    assert sched.abort("req-1") is b and b.finish_reason == "abort" and b.is_finished
    assert b not in sched.waiting and "req-1" not in sched.by_request
    check_invariants(sched)
    d.run()
    assert_all_free(sched)


def test_abort_mid_prefill_frees_blocks_and_slot():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = Driver(sched)
    a = d.add(make_seq(0, 14, max_tokens=3))
    d.step()
    d.step()
    assert a.is_prefilling and sched.stats().kv_blocks_used == 2 and sched.stats().state_slots_used == 1
    sched.abort("req-0")
    assert_all_free(sched)
    d.run()  # the chunk still in flight is dropped
    assert d.tokens("req-0") == []


@pytest.mark.parametrize("zos", [True, False])
def test_abort_running_with_step_in_flight_is_idempotent(zos):
    sched = make_scheduler()
    d = Driver(sched, zos=zos)
    a = d.add(make_seq(0, 6, max_tokens=20))
    b = d.add(make_seq(1, 6, max_tokens=5))
    for _ in range(3):
        d.step()
    got = list(a.output_token_ids)
    seq = sched.abort("req-0")
    assert seq is a and a.finish_reason == "abort" and a.block_table == [] and a.slot is None
    assert sched.abort("req-0") is None and sched.abort("nope") is None
    check_invariants(sched)
    d.run()
    assert a.output_token_ids == got  # nothing applied after the abort
    assert d.tokens("req-1") == expected_outputs(b, 512)[0]
    assert_all_free(sched)
    # the id can be used again once aborted
    d.add(Sequence(5, "req-0", [3, 4, 5], SamplingParams(max_tokens=2), seed=1))
    d.run()
    assert_all_free(sched)


def test_abort_between_schedule_and_update_of_the_speculative_step():
    sched = make_scheduler()
    a = make_seq(0, 6, max_tokens=20)
    sched.add(a)
    p1 = sched.schedule()
    p2 = sched.schedule()
    sched.abort("req-0")
    assert_all_free(sched)
    assert sched.update(sample_results(p1)) == [] and sched.update(sample_results(p2)) == []
    assert sched.schedule() is None and not sched.has_work


def test_abort_preempted_sequence_in_waiting_queue():
    sched, d, a, b, c, late = _lockstep_setup()
    while not d.preempted:
        d.step()
    assert c in sched.waiting
    assert sched.abort(c.request_id) is c
    assert c not in sched.waiting and c.finish_reason == "abort"
    check_invariants(sched)
    d.run()
    assert d.tokens(c.request_id) == c.output_token_ids  # nothing after the abort
    assert_all_free(sched)


# ============================================================================= prompt logprobs
def test_prompt_logprob_targets_per_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = Driver(sched)
    seq = d.add(make_seq(0, 10, max_tokens=2, prompt_logprobs=2))
    d.run()
    prompt = seq.prompt_token_ids
    chunks = [s for p in d.plans for s in rows(p) if p.is_prefill]
    assert [(c.start, c.prompt_logprob_targets) for c in chunks] == [
        (0, prompt[1:5]), (4, prompt[5:9]), (8, prompt[9:10])]
    assert [c.params is not None for c in chunks] == [True, True, True]
    decode = [s for p in d.plans for s in rows(p) if not p.is_prefill]
    assert decode and all(s.prompt_logprob_targets == [] for s in decode)
    outs = [o for o in d.outputs["req-0"] if o.prompt_logprobs is not None]
    assert len(outs) == 1
    assert [lp.token_id for lp in outs[0].prompt_logprobs] == prompt[1:]


def test_prompt_logprobs_after_preemption_mid_prefill_are_complete_and_not_duplicated():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = Driver(sched, zos=False)
    seq = d.add(make_seq(0, 10, max_tokens=2, prompt_logprobs=0))
    d.step()
    d.step()
    assert len(seq.prompt_logprobs) == 8
    sched._preempt(seq)
    d.run()
    outs = [o for o in d.outputs["req-0"] if o.prompt_logprobs is not None]
    assert len(outs) == 1 and [lp.token_id for lp in outs[0].prompt_logprobs] == seq.prompt_token_ids[1:]


def test_one_token_prompt_has_no_prompt_logprob_targets():
    d, seq = _run_one(prompt_len=1, max_tokens=2, prompt_logprobs=1)
    assert all(s.prompt_logprob_targets == [] for p in d.plans for s in rows(p))
    assert len(d.tokens("req-0")) == 2


# ============================================================================= validation
def test_prompt_too_long_for_max_model_len_is_rejected_at_add():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="does not fit"):
        sched.add(make_seq(0, 16))
    sched.add(make_seq(1, 15, max_tokens=5))  # one position left for an output
    assert not sched.live.get(0) and 1 in sched.live


def test_prompt_too_long_for_kv_capacity_is_rejected_at_add():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=512)  # 16 tokens of KV
    with pytest.raises(ValueError, match="KV capacity"):
        sched.add(make_seq(0, 16))
    assert not sched.has_work and sched.stats().waiting == 0


def test_duplicate_live_request_id_is_rejected():
    sched = make_scheduler()
    sched.add(make_seq(0, 4))
    with pytest.raises(ValueError, match="already"):
        sched.add(Sequence(9, "req-0", [1, 2], SamplingParams(), seed=0))
    assert len(sched.live) == 1


def test_empty_scheduler_plans_nothing():
    sched = make_scheduler()
    assert sched.config.block_size == 4 and sched.ranks[0].blocks.capacity == 63
    assert sched.schedule() is None and not sched.has_work


def test_randomized_zos_drive_keeps_tokens_right():
    """Random arrivals against tight blocks: every plan passes the FakeRunner's cache checks."""
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=12, max_num_seqs=5,
                           num_state_slots=4, max_model_len=40)
    d = Driver(sched)
    seqs = []
    for i in range(30):
        seqs.append(d.add(make_seq(i, rng.randint(1, 20), max_tokens=rng.randint(0, 15))))
        for _ in range(rng.randint(0, 3)):
            d.step()
            check_invariants(sched)
    d.run()
    assert sched.num_preemptions > 0
    for s in seqs:
        assert (d.tokens(s.request_id), d.finish_reason(s.request_id)) == expected_outputs(s, 40)
    assert_all_free(sched)
