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

from collections import defaultdict


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
                # a decode row belongs to a sequence that sampled in this epoch; the others are
                # (re)prefill chunks. Without mixed steps a step holds one kind only.
                decode_row = (step.seq_id, step.epoch) in self.sampled_epochs
                if not self.sched.config.mixed_steps:
                    assert decode_row == (not plan.is_prefill), \
                        f"step {plan.step_id}: seq {step.seq_id} in a {'prefill' if plan.is_prefill else 'decode'} step"
                if decode_row:
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
            chunks = [s for s in batch.sequences if (s.seq_id, s.epoch) not in self.sampled_epochs]
            assert bool(chunks) <= plan.is_prefill, f"step {plan.step_id}: prompt chunks in a step not marked prefill"
            for step in batch.sequences:
                if step.sample:
                    self.sampled_epochs.add((step.seq_id, step.epoch))
            if chunks:  # decode rows count against the budget too
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

def lockstep_setup():
    """a, b, c admitted in one step (so they decode in lockstep under ZOS); 6 usable blocks of 4 tokens.

    Prompts 3, 4, 4: b and c open their second block at their first decode, a at its second; at
    the fifth decode b needs a third block and none is free. A fourth request waits (max_num_seqs).
    """
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
    d = Driver(sched)
    a, b, c = (d.add(make_seq(i, n, max_tokens=20)) for i, n in enumerate([3, 4, 4]))
    late = d.add(make_seq(3, 2, max_tokens=3))
    return sched, d, a, b, c, late
