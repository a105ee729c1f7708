"""Scheduler: finish conditions, aborts, prompt logprobs and request validation, with fake model
outputs (see scheduler_harness.py)."""

from __future__ import annotations

import random

import pytest

from engine_core.protocol import SamplingParams
from engine_core.sequence import Sequence
from scheduler_harness import (
    fake_token, make_scheduler, make_seq, sample_results, rows, Driver,
    expected_outputs, check_invariants, assert_all_free, EOS, STOP, lockstep_setup,
)


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
    sched, d, a, b, c, late = lockstep_setup()
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
