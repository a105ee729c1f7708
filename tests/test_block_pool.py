"""Block and slot accounting: the RefCountedPool itself, and the scheduler giving every block and
slot back after finished, aborted and preempted sequences (including a seeded random walk of many
operations that checks the invariants after each one)."""

from __future__ import annotations

import random

import pytest

from engine_core.block_pool import PoolExhausted, RefCountedPool
from engine_core.sequence import SequenceStatus

from scheduler_harness import (  # the fake device and driver live with the scheduler tests
    EOS,
    STOP,
    Driver,
    assert_all_free,
    check_invariants,
    expected_outputs,
    fake_token,
    make_scheduler,
    make_seq,
)


# ============================================================================= RefCountedPool
def test_reserved_ids_are_never_handed_out():
    pool = RefCountedPool(5, reserved=1, name="blocks")
    assert pool.capacity == 4 and pool.num_free == 4 and pool.num_used == 0
    ids = pool.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4]
    assert pool.num_free == 0 and pool.num_used == 4 and not pool.can_allocate(1)
    pool.free(ids)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]


def test_slots_use_every_id():
    pool = RefCountedPool(3, name="slots")
    assert sorted(pool.allocate(3)) == [0, 1, 2]


def test_exhaustion_raises_and_allocates_nothing():
    pool = RefCountedPool(4, reserved=1)
    pool.allocate(2)
    with pytest.raises(PoolExhausted, match="3 requested, 1 free"):
        pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 2
    assert pool.allocate(0) == [] and pool.num_free == 1
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_ids_are_reused_in_fifo_order_of_release():
    pool = RefCountedPool(6, reserved=1)
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    pool.free([2])
    pool.free([1])
    # never-used ids first, then the released ones in release order: deterministic allocation
    assert pool.allocate(4) == [4, 5, 2, 1]


def test_double_free_and_incref_of_free_id_raise():
    pool = RefCountedPool(4, reserved=1)
    (i,) = pool.allocate(1)
    pool.free([i])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([i])
    with pytest.raises(ValueError, match="incref of free id"):
        pool.incref([i])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([0])  # the reserved padding block is never owned
    assert pool.num_free == 3


def test_shared_id_is_reused_only_at_refcount_zero():
    pool = RefCountedPool(3, reserved=1)
    ids = pool.allocate(2)
    pool.incref([ids[0]])
    pool.free(ids)
    assert pool.num_used == 1 and pool.allocate(1) == [ids[1]]
    assert not pool.can_allocate(1)
    pool.free([ids[0]])
    assert pool.allocate(1) == [ids[0]]


@pytest.mark.parametrize("size,reserved", [(1, 1), (0, 0), (2, 3)])
def test_pool_without_usable_ids_is_rejected(size, reserved):
    with pytest.raises(ValueError, match="leaves nothing"):
        RefCountedPool(size, reserved=reserved)


def test_random_pool_operations_keep_counts_consistent():
    rng = random.Random(3)
    pool = RefCountedPool(17, reserved=1)
    owned: dict[int, int] = {}  # id -> references held by the test
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 5)
            if n > pool.num_free:
                with pytest.raises(PoolExhausted):
                    pool.allocate(n)
            else:
                for i in pool.allocate(n):
                    assert i != 0 and i not in owned
                    owned[i] = 1
        elif op < 0.55 and owned:
            i = rng.choice(sorted(owned))
            pool.incref([i])
            owned[i] += 1
        elif owned:
            i = rng.choice(sorted(owned))
            pool.free([i])
            owned[i] -= 1
            if not owned[i]:
                del owned[i]
        assert pool.num_used == len(owned) and pool.num_free + pool.num_used == pool.capacity
        assert len(set(pool._free)) == len(pool._free) and not set(pool._free) & set(owned)
        assert all(pool._refcount[i] == owned.get(i, 0) for i in range(17))


# ============================================================================= scheduler accounting
@pytest.mark.parametrize("zos", [True, False])
def test_finished_sequences_return_everything(zos):
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=8)
    d = Driver(sched, zos=zos)
    for i, n in enumerate([1, 4, 5, 17, 9]):
        d.add(make_seq(i, n, max_tokens=i + 1))
    d.step()
    assert sched.stats().kv_blocks_used > 0 and sched.stats().state_slots_used > 0
    d.run()
    assert all(d.finish_reason(f"req-{i}") == "length" for i in range(5))
    assert_all_free(sched)


def test_aborts_at_every_stage_return_everything():
    sched = make_scheduler(max_num_batched_tokens=6, max_num_seqs=2)
    d = Driver(sched)
    decoding = d.add(make_seq(0, 2, max_tokens=50))
    mid_prefill = d.add(make_seq(1, 30, max_tokens=5))
    queued = d.add(make_seq(2, 3, max_tokens=5))
    for _ in range(3):
        d.step()
    assert mid_prefill.num_cached_tokens < mid_prefill.num_prompt_tokens and mid_prefill.block_table
    assert decoding.output_token_ids and decoding.status is SequenceStatus.RUNNING
    assert queued.status is SequenceStatus.WAITING
    assert sched.abort("req-1") is mid_prefill
    check_invariants(sched)
    assert sched.abort("req-0") is decoding  # a step of it is in flight
    check_invariants(sched)
    d.step()
    assert queued.status is SequenceStatus.RUNNING and queued.num_inflight_tokens == 1
    assert sched.abort("req-2") is queued  # its prefill is in flight
    check_invariants(sched)
    d.run()
    assert_all_free(sched)
    assert [sched.abort(f"req-{i}") for i in range(3)] == [None] * 3


def test_preempted_sequences_hold_nothing_while_waiting():
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=6)
    d = Driver(sched)
    seqs = [d.add(make_seq(i, 3 + i, max_tokens=12)) for i in range(5)]
    seen_waiting_preempted = False
    while sched.has_work or d.in_flight is not None:
        d.step()
        check_invariants(sched)
        for s in sched.waiting:
            if s.epoch > 0:
                seen_waiting_preempted = True
                assert not s.block_table and s.slot is None
    assert seen_waiting_preempted and sched.num_preemptions > 0
    for s in seqs:
        assert d.tokens(s.request_id) == expected_outputs(s, 512)[0]
    assert_all_free(sched)


def _noisy_token(seq_id: int, position: int) -> int:
    """The fake model, with EOS and STOP now and then (a pure function of seq and position)."""
    h = (seq_id * 7919 + position * 104729) % 997
    if h < 30:
        return EOS
    if h < 50:
        return STOP
    return fake_token(seq_id, position)


@pytest.mark.parametrize("seed,zos,dp,mixed", [(0, True, 1, True), (1, False, 1, True), (2, True, 2, True),
                                              (3, True, 1, True), (4, False, 2, True), (5, True, 1, False),
                                              (6, True, 2, False)])
def test_random_operations_keep_the_invariants(seed, zos, dp, mixed):
    rng = random.Random(seed)
    max_len = 40
    # capacity (11 blocks x 4 = 44 tokens per rank) >= max_model_len: every sequence fits alone
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=rng.choice([5, 12, 64]),
                           max_num_seqs=4, num_state_slots=3, max_model_len=max_len, dp_size=dp, mixed_steps=mixed)
    d = Driver(sched, zos=zos, token_fn=_noisy_token)
    seqs, aborted, next_id = [], set(), 0
    for _ in range(400):
        op = rng.random()
        if op < 0.2:
            params = dict(max_tokens=rng.choice([0, 1, 3, 8, 20, 40]), min_tokens=rng.choice([0, 0, 2, 5]),
                          stop_token_ids=rng.choice([(), (STOP,)]), ignore_eos=rng.random() < 0.2)
            if rng.random() < 0.25:
                params["prompt_logprobs"] = rng.choice([0, 2])
            seqs.append(d.add(make_seq(next_id, rng.randint(1, max_len - 1), **params)))
            next_id += 1
        elif op < 0.27 and seqs:
            victim = rng.choice(seqs)
            was_live = victim.seq_id in sched.live
            assert (sched.abort(victim.request_id) is victim) == was_live
            if was_live:
                aborted.add(victim.seq_id)
        elif op < 0.29 and sched.live:  # an arbitrary preemption, as when another rank's work needs room
            running = [s for rank in sched.ranks for s in rank.running]
            if running:
                sched._preempt(rng.choice(running))
        else:
            d.step()
        check_invariants(sched)
    d.run(max_steps=5000)
    check_invariants(sched)
    assert_all_free(sched)
    assert sched.num_preemptions > 0
    for s in seqs:
        want, reason = expected_outputs(s, max_len, _noisy_token)
        got = d.tokens(s.request_id)
        assert got == s.output_token_ids
        if s.seq_id in aborted:
            assert s.finish_reason == "abort" and got == want[:len(got)]
            continue
        assert (got, d.finish_reason(s.request_id)) == (want, reason), s.request_id
        if s.params.prompt_logprobs is not None:
            sent = [o.prompt_logprobs for o in d.outputs[s.request_id] if o.prompt_logprobs is not None]
            assert len(sent) == 1 and [lp.token_id for lp in sent[0]] == s.prompt_token_ids[1:]
