"""DP balance: where new sequences go when there are several ranks, and what /metrics shows per rank.

Scheduler level (fake device, tests/scheduler_harness.py): after every planning call, a sequence
may still wait only if no rank could have admitted the head of the queue in that step (every rank
is out of seats, state slots, KV blocks for the first chunk, or this step's token budget), and
skewed arrival patterns (long requests first, then a burst of short ones; arrivals while one rank
is full; a rank with free blocks but few free seats) give every rank work and the right tokens.
Server level: a real two-rank ``serve`` exports running sequences, KV usage, preemptions and
scheduled tokens per rank with the ``dp_rank`` label, summing to the aggregated gauges.
"""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import openai
import pytest
from scheduler_harness import Driver, EOS, assert_all_free, check_invariants, expected_outputs, make_seq
from server_harness import start_server, stop_server

from engine_core.scheduler import Scheduler, SchedulerConfig
from engine_core.sequence import SequenceStatus


class CheckedScheduler(Scheduler):
    """Checks after each planning call that nobody waits while a rank could take the head."""

    def schedule(self):
        preemptions = self.num_preemptions
        plan = super().schedule()
        if self.num_preemptions == preemptions:  # a sequence just preempted waits for the next step
            assert_no_rank_could_take_the_head(self, plan)
        check_rank_stats(self)
        return plan


def assert_no_rank_could_take_the_head(sched: Scheduler, plan) -> None:
    if not sched.waiting:
        return
    head, cfg = sched.waiting[0], sched.config
    for r, rank in enumerate(sched.ranks):
        used = sum(len(s.token_ids) for s in plan.ranks[r].sequences) if plan is not None and plan.is_prefill else 0
        budget = cfg.max_num_batched_tokens - used
        first_chunk_blocks = -(-min(head.num_tokens, budget) // cfg.block_size)
        could = (budget > 0 and len(rank.running) < cfg.max_num_seqs and rank.slots.num_free > 0
                 and rank.blocks.num_free >= first_chunk_blocks)
        assert not could, (f"step {plan and plan.step_id}: seq {head.seq_id} waits while rank {r} has room "
                           f"({len(rank.running)} running, {rank.blocks.num_free} free blocks, budget {budget})")


def check_rank_stats(sched: Scheduler) -> None:
    """The per-rank values of the stats sum to the aggregated ones and match the pools."""
    stats = sched.stats()
    assert len(stats.rank_running) == len(sched.ranks)
    assert sum(stats.rank_running) == stats.running
    assert sum(stats.rank_kv_blocks_used) == stats.kv_blocks_used
    assert sum(stats.rank_kv_blocks_total) == stats.kv_blocks_total
    assert sum(stats.rank_state_slots_used) == stats.state_slots_used
    assert sum(stats.rank_state_slots_total) == stats.state_slots_total
    assert sum(stats.rank_preemptions) == stats.preemptions
    assert sum(stats.rank_tokens_scheduled) == stats.step_tokens_sum
    for r, rank in enumerate(sched.ranks):
        assert stats.rank_running[r] == len(rank.running)
        assert stats.rank_kv_blocks_used[r] == sum(len(s.block_table) for s in rank.running)


def make_checked(**overrides) -> CheckedScheduler:
    values = dict(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=64, num_state_slots=8, block_size=4,
                  max_model_len=512, eos_token_id=EOS, dp_size=2)
    values.update(overrides)
    return CheckedScheduler(SchedulerConfig(**values))


def run_and_check_tokens(d: Driver) -> None:
    d.run()
    for seq in d.seqs.values():
        want, reason = expected_outputs(seq, d.sched.max_len)
        assert d.tokens(seq.request_id) == want and d.finish_reason(seq.request_id) == reason, seq.seq_id
    assert_all_free(d.sched)


def test_a_burst_of_short_requests_after_long_ones_is_spread_over_every_rank():
    """Three long prompts (two end up on one rank), then ten short ones while they are still in
    prefill and decode: the short ones go where there is room, which is every rank."""
    sched = make_checked(dp_size=2, max_num_seqs=6, num_blocks=81)
    d = Driver(sched)
    longs = [d.add(make_seq(i, 60, max_tokens=30, ignore_eos=True)) for i in range(3)]
    for _ in range(3):
        d.step()
    assert {s.dp_rank for s in longs} == {0, 1}
    shorts = [d.add(make_seq(10 + i, 3, max_tokens=6, ignore_eos=True)) for i in range(10)]
    ranks_running_shorts = set()
    while any(s.status is SequenceStatus.WAITING for s in shorts):
        d.step()
        check_invariants(sched)
        ranks_running_shorts |= {s.dp_rank for s in shorts if s.status is SequenceStatus.RUNNING}
    assert ranks_running_shorts == {0, 1}
    per_rank = [sum(1 for s in shorts if s.dp_rank == r) for r in range(2)]
    assert min(per_rank) >= 4, per_rank  # the rank with two long prompts still takes its share
    run_and_check_tokens(d)
    assert sched.num_preemptions == 0
    assert all(t > 0 for t in sched.stats().rank_tokens_scheduled)


def test_requests_arriving_while_one_rank_is_full_go_to_the_other_at_once():
    sched = make_checked(dp_size=2, max_num_seqs=2)
    d = Driver(sched)
    first = [d.add(make_seq(i, 5, max_tokens=40, ignore_eos=True)) for i in range(3)]
    d.step()
    full = [r for r in range(2) if len(sched.ranks[r].running) == 2]
    assert len(full) == 1 and all(s.status is SequenceStatus.RUNNING for s in first)
    late = d.add(make_seq(3, 4, max_tokens=3, ignore_eos=True))
    d.step()  # the very next plan admits it, on the rank with a free seat
    assert late.status is SequenceStatus.RUNNING and late.dp_rank == 1 - full[0]
    queued = d.add(make_seq(4, 4, max_tokens=3, ignore_eos=True))  # every seat taken: it waits ...
    d.step()
    assert queued.status is SequenceStatus.WAITING
    while queued.status is SequenceStatus.WAITING:  # ... until `late` finishes and frees its seat
        d.step()
    assert d.finish_reason(late.request_id) == "length" and queued.dp_rank == late.dp_rank
    run_and_check_tokens(d)


def test_a_rank_with_free_blocks_but_few_free_seats_is_not_preferred():
    """Rank 0 holds one long sequence (half its blocks), then four short ones arrive. By free blocks
    alone all four would go to rank 1 (4 running against 1: every lockstep step as slow as rank 1's
    batch); by the tightest limit, rank 1 takes two, then rank 0's seats weigh as much as its
    blocks and the shorts are shared (2 and 3 running)."""
    # (without mixed steps: the long sequence's decode row would take a block before the shorts are placed)
    sched = make_checked(dp_size=2, max_num_seqs=4, num_state_slots=4, num_blocks=33, max_num_batched_tokens=64,
                         mixed_steps=False)
    d = Driver(sched)
    long = d.add(make_seq(0, 64, max_tokens=40, ignore_eos=True))
    d.step()
    assert long.dp_rank == 0 and sched.ranks[0].blocks.num_free == 16
    shorts = [d.add(make_seq(1 + i, 3, max_tokens=20, ignore_eos=True)) for i in range(4)]
    d.step()
    assert [s.dp_rank for s in shorts] == [1, 1, 0, 1]
    assert [len(rank.running) for rank in sched.ranks] == [2, 3]
    run_and_check_tokens(d)


@pytest.mark.parametrize("seed", range(6))
def test_random_skewed_arrivals_never_leave_a_rank_idle_while_others_queue(seed):
    """Random arrivals over time, bursts and long prompts mixed, on three ranks: every plan passes
    the no-needless-wait check (CheckedScheduler), every rank gets work, every token is right."""
    rng = random.Random(seed)
    sched = make_checked(dp_size=3, max_num_seqs=4, num_blocks=48, num_state_slots=4, max_num_batched_tokens=24)
    d = Driver(sched)
    next_id = 0
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            for _ in range(rng.choice([1, 1, 2, 6])):  # sometimes a burst
                prompt = rng.choice([2, 3, 5, 40, 70])
                d.add(make_seq(next_id, prompt, max_tokens=rng.randint(1, 25), ignore_eos=True))
                next_id += 1
        d.step()
        check_invariants(sched)
        if step >= 200 and not sched.has_work:
            break
    run_and_check_tokens(d)
    assert all(t > 0 for t in sched.stats().rank_tokens_scheduled)


# ----------------------------------------------------------------------------- a real two-rank server

def _samples(text: str, name: str) -> dict[str, float]:
    """dp_rank -> value of one per-rank family, from the Prometheus text format."""
    found = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found[dict(re.findall(r'(\w+)="([^"]*)"', labels))["dp_rank"]] = float(value)
    return found


def _total(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_a_two_rank_server_exports_per_rank_load_and_uses_both_ranks(tiny_checkpoint):
    """Two long streams start first, then a burst of four more: while all six run, both ranks run
    sequences and hold KV blocks, and the per-rank gauges sum to the aggregated ones."""
    process, base = start_server(tiny_checkpoint, "-dp", "2", max_num_seqs=4)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    streaming = threading.Semaphore(0)  # one release per stream that has its first token
    release = threading.Event()
    errors: list[BaseException] = []

    def stream(prompt: str, max_tokens: int) -> None:
        try:
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for i, _ in enumerate(chunks):
                if i == 0:
                    streaming.release()
                    release.wait(timeout=60)  # hold the stream open (the engine goes on) while /metrics is read
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)
            streaming.release()

    def wait_streaming(count: int) -> None:
        for _ in range(count):
            assert streaming.acquire(timeout=120), "a stream did not start"
        assert not errors, errors

    try:
        idle = httpx.get(f"{base}/metrics").text
        assert _samples(idle, "minideepinfer:num_requests_running_per_rank") == {"0": 0.0, "1": 0.0}
        threads = [threading.Thread(target=stream, args=("A long story begins here: " * 3, 200)) for _ in range(2)]
        for t in threads:
            t.start()
        wait_streaming(2)  # the long ones run ...
        burst = [threading.Thread(target=stream, args=(f"Short {i}", 150)) for i in range(4)]
        for t in burst:  # ... then a burst arrives
            t.start()
        wait_streaming(4)
        text = httpx.get(f"{base}/metrics").text
        release.set()
        running = _samples(text, "minideepinfer:num_requests_running_per_rank")
        assert set(running) == {"0", "1"}
        assert sum(running.values()) == _total(text, "minideepinfer:num_requests_running")
        assert sum(running.values()) == 6 and min(running.values()) >= 2, running
        blocks = _samples(text, "minideepinfer:kv_blocks_used_per_rank")
        assert min(blocks.values()) > 0 and sum(blocks.values()) == _total(text, "minideepinfer:kv_blocks_used")
        usage = _samples(text, "minideepinfer:kv_cache_usage_perc_per_rank")
        assert all(0 < u <= 1 for u in usage.values())
        assert _samples(text, "minideepinfer:state_slots_used_per_rank") == running
        assert min(_samples(text, "minideepinfer:scheduled_tokens_per_rank_total").values()) > 0
        assert _samples(text, "minideepinfer:num_preemptions_per_rank_total") == {"0": 0.0, "1": 0.0}
        assert 'engine="0"' in re.search(r"^minideepinfer:num_requests_running_per_rank\{.*$", text, re.M).group(0)
        assert "vllm:num_requests_running_per_rank" not in text  # ours only: vLLM has no such metric
        for t in threads + burst:
            t.join(timeout=120)
        assert not errors, errors
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = httpx.get(f"{base}/metrics").text
            if _total(after, "minideepinfer:num_requests_running") == 0:
                break
            time.sleep(0.1)
        assert _samples(after, "minideepinfer:num_requests_running_per_rank") == {"0": 0.0, "1": 0.0}
        assert _samples(after, "minideepinfer:kv_blocks_used_per_rank") == {"0": 0.0, "1": 0.0}
    finally:
        release.set()
        stop_server(process)
