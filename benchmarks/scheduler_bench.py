"""CPU time of the scheduler per step: ``schedule()`` + ``update()`` with fake model outputs.

The loop is the engine's zero-overhead-scheduling order: plan step N+1, then apply step N's
sampled tokens (fabricated here; building them is not timed). Cases:

* decode, 1 / 64 / 256 / 1024 running sequences: prompts of 1.5k-2.5k tokens with 128-token blocks
  (12-20 blocks per sequence, one more every 128 steps), all admitted in one prefill step so that
  they decode in lockstep; ``max_tokens`` is never reached during the measurement.
* prefill-heavy: 256 waiting prompts of 1.5k-2.5k tokens, chunked at 8192 tokens per step.

Usage: ``python benchmarks/scheduler_bench.py [--steps-scale 1.0] [--dp 1]``
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.protocol import SampledToken, SamplingParams, StepPlan, StepResult  # noqa: E402
from engine_core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from engine_core.sequence import Sequence  # noqa: E402

BLOCK_SIZE = 128
MAX_MODEL_LEN = 16384
EOS = 1


def fake_results(plan: StepPlan) -> list[StepResult]:
    out = []
    for r, batch in enumerate(plan.ranks):
        tokens = [SampledToken(s.seq_id, s.epoch, 1000 + (s.start & 1023)) for s in batch.sequences if s.sample]
        out.append(StepResult(plan.step_id, r, tokens))
    return out


def make_scheduler(num_seqs: int, batched_tokens: int, dp: int) -> Scheduler:
    per_rank = -(-num_seqs // dp)
    blocks_per_seq = -(-5120 // BLOCK_SIZE)  # 2.5k prompt + 2k measured steps fit: no preemption
    return Scheduler(SchedulerConfig(
        max_num_seqs=per_rank, max_num_batched_tokens=batched_tokens,
        num_blocks=1 + per_rank * blocks_per_seq, num_state_slots=per_rank, block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN, eos_token_id=EOS, dp_size=dp))


def add_requests(sched: Scheduler, n: int, rng: random.Random) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10_000)
    for i in range(n):
        length = rng.randint(1500, 2500)
        prompt = [rng.randrange(2, 120000) for _ in range(length)]
        sched.add(Sequence(i, f"r{i}", prompt, params, seed=i, arrival_time=float(i)))


def timed_steps(sched: Scheduler, steps: int, in_flight: list[StepResult] | None):
    """ZOS loop; returns per-step (ns, rows in the plan) and the results still in flight."""
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        plan = sched.schedule()
        t1 = time.perf_counter_ns()
        results = fake_results(plan) if plan is not None else None  # the device's work: not timed
        t2 = time.perf_counter_ns()
        if in_flight is not None:
            sched.update(in_flight)
        t3 = time.perf_counter_ns()
        in_flight = results
        rows = sum(len(b.sequences) for b in plan.ranks) if plan is not None else 0
        samples.append(((t1 - t0) + (t3 - t2), rows, plan.is_prefill if plan is not None else None))
    return samples, in_flight


def decode_case(n: int, steps: int, dp: int, rng: random.Random) -> dict:
    sched = make_scheduler(n, batched_tokens=n * 2500, dp=dp)  # one prefill step admits everything
    add_requests(sched, n, rng)
    first = sched.schedule()
    assert first.is_prefill and sum(len(b.sequences) for b in first.ranks) == n
    in_flight = fake_results(first)
    gc.collect()
    samples, _ = timed_steps(sched, steps, in_flight)
    assert all(rows == n and not is_prefill for _, rows, is_prefill in samples), "not a steady decode batch"
    blocks = sched.stats().kv_blocks_used / n
    return summarize(f"decode, {n} running", n, samples, f"{blocks:.1f} blocks/seq at the end")


def prefill_case(n: int, steps: int, dp: int, rng: random.Random) -> dict:
    sched = make_scheduler(n, batched_tokens=8192, dp=dp)
    add_requests(sched, n, rng)
    gc.collect()
    samples, _ = timed_steps(sched, steps, None)
    samples = [s for s in samples if s[2]]  # prefill steps only
    rows = statistics.mean(r for _, r, _ in samples)
    return summarize(f"prefill, {n} waiting, 8192 tok/step", rows, samples, f"{rows:.1f} chunks/step")


def summarize(name: str, per_step_seqs: float, samples, note: str) -> dict:
    us = sorted(ns / 1000 for ns, _, _ in samples)
    p90 = us[min(len(us) - 1, int(0.9 * len(us)))]
    med = statistics.median(us)
    return dict(name=name, steps=len(us), median=med, p90=p90, med_seq=med / per_step_seqs,
                p90_seq=p90 / per_step_seqs, note=note)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()} ({platform.python_implementation()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale the number of measured steps")
    parser.add_argument("--dp", type=int, default=1, help="DP ranks the scheduler plans for")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for n in (1, 64, 256, 1024):
        steps = max(30, int(min(2000, 100_000 // n) * args.steps_scale))
        rows.append(decode_case(n, steps, args.dp, rng))
    rows.append(prefill_case(256, max(30, int(60 * args.steps_scale)), args.dp, rng))
    print(f"scheduler CPU time per step (schedule + update, ZOS order, fake outputs); dp={args.dp}, "
          f"block_size={BLOCK_SIZE}")
    print(f"machine: {machine()}")
    header = f"{'case':<36} {'steps':>6} {'median us/step':>15} {'p90 us/step':>12} {'median us/seq':>14} " \
             f"{'p90 us/seq':>11}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<36} {r['steps']:>6} {r['median']:>15.1f} {r['p90']:>12.1f} {r['med_seq']:>14.2f} "
              f"{r['p90_seq']:>11.2f}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
