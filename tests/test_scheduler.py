"""Scheduler planning: chunking, the decode advance rule, zero-overhead scheduling, preemption
and admission, with fake model outputs (see scheduler_harness.py)."""

from __future__ import annotations

import pytest

from engine_core.protocol import SampledToken, StepResult
from engine_core.sequence import SequenceStatus
from scheduler_harness import (
    make_scheduler, make_seq, sample_results, rows, Driver, expected_outputs, check_invariants,
    assert_all_free, EOS, lockstep_setup,
)


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
    sched = make_scheduler(max_num_batched_tokens=10, block_size=4, mixed_steps=False)
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
def test_without_mixed_steps_a_step_is_prefill_or_decode_never_both(zos):
    sched = make_scheduler(max_num_batched_tokens=6, mixed_steps=False)
    d = Driver(sched, zos=zos)
    d.add(make_seq(0, 5, max_tokens=12))
    for _ in range(4):
        d.step()
    d.add(make_seq(1, 20, max_tokens=4))  # arrives while seq 0 decodes: 4 prefill chunks
    d.run()  # the Driver checks every plan: prefill rows never sampled before, decode rows all did
    chunk_plans = [p for p in d.plans if any(s.seq_id == 1 and not s.sample for s in rows(p))]
    assert len(chunk_plans) == 3 and all(p.is_prefill and len(rows(p)) == 1 for p in chunk_plans)
    assert sum(not p.is_prefill and {s.seq_id for s in rows(p)} == {0, 1} for p in d.plans) >= 3


@pytest.mark.parametrize("zos", [False, True])
def test_mixed_steps_decode_first_and_give_prompts_the_budget_left(zos):
    """A sequence that decodes gets its token in every step while another prompt is chunked beside
    it; the chunk takes what the decode row leaves of the budget."""
    sched = make_scheduler(max_num_batched_tokens=6, mixed_steps=True)
    d = Driver(sched, zos=zos)
    first = d.add(make_seq(0, 5, max_tokens=12))
    for _ in range(4):
        d.step()
    second = d.add(make_seq(1, 20, max_tokens=4))
    d.run()  # the Driver checks every row: decode rows follow the advance rule, chunks are contiguous
    chunk_plans = [p for p in d.plans if any(s.seq_id == 1 and len(s.token_ids) > 1 for s in rows(p))]
    assert [[(s.seq_id, len(s.token_ids)) for s in rows(p)] for p in chunk_plans] == [[(0, 1), (1, 5)]] * 4
    assert all(p.is_prefill for p in chunk_plans)
    for seq in (first, second):
        assert d.tokens(seq.request_id) == expected_outputs(seq, 512)[0]
    assert_all_free(sched)


def test_decode_rows_beyond_the_budget_leave_no_room_for_prompts():
    sched = make_scheduler(max_num_batched_tokens=2, mixed_steps=True)
    d = Driver(sched, zos=False)
    running = [d.add(make_seq(i, 1, max_tokens=6)) for i in range(2)]
    d.step()  # both one-token prompts in one step
    late = d.add(make_seq(2, 2, max_tokens=2))
    plan = d.step()
    assert [s.seq_id for s in rows(plan)] == [0, 1] and not plan.is_prefill  # two decode rows fill it
    assert late.status is SequenceStatus.WAITING
    d.run()
    for seq in running + [late]:
        assert d.tokens(seq.request_id) == expected_outputs(seq, 512)[0]
    assert_all_free(sched)


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


def test_preemption_frees_blocks_and_slot_bumps_epoch_and_requeues_at_the_front():
    sched, d, a, b, c, late = lockstep_setup()
    while not d.preempted:
        plan = d.step()
        check_invariants(sched)
    assert not plan.is_prefill and len(d.plans) == 6  # prefill + the fifth decode step
    victim, running = d.preempted[0]
    # the latest arrival (c) goes, although b is the one that needed a block
    assert victim == 2 and sorted(running) == [(0, 5), (1, 5), (2, 5)]
    assert {s.seq_id for s in rows(plan)} == {0, 1}
    assert sched.num_preemptions == 1 and sched.stats().preemptions == 1
    assert c.status is SequenceStatus.WAITING and list(sched.waiting) == [c, late]
    assert c.block_table == [] and c.slot is None and c.epoch == 1
    assert c.num_cached_tokens == 0 and c.num_inflight_tokens == 0
    assert sched.stats().kv_blocks_used == 6 - 2 + 1 and sched.stats().state_slots_used == 2  # c gave 2, b took 1


def test_preempted_sequence_is_recomputed_from_position_0_with_its_outputs():
    sched, d, a, b, c, late = lockstep_setup()
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


def test_preemption_victim_is_the_latest_arrival_not_the_longest_output():
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
    assert victim == 2 and outputs[0] > max(outputs[1], outputs[2])  # 0 has the longest output, yet stays
    assert not d.plans[-1].is_prefill and 2 not in {s.seq_id for s in rows(d.plans[-1])}


@pytest.mark.parametrize("mixed_steps", [True, False])
def test_after_a_prefill_step_all_running_sequences_decode_in_every_step(mixed_steps):
    sched = make_scheduler(mixed_steps=mixed_steps)
    d = Driver(sched)
    d.add(make_seq(0, 4, max_tokens=30))
    for _ in range(3):
        d.step()
    d.add(make_seq(1, 4, max_tokens=10))
    admitted = d.step()  # with mixed steps the running sequence decodes beside the new prompt
    assert [s.seq_id for s in rows(admitted)] == ([0, 1] if mixed_steps else [1])
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
