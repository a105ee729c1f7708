"""Engine-level determinism with the real tiny model, batch-invariant (the CPU default; on CUDA
asked for, with decode steps replaying CUDA graphs and the Triton kernels).

The same request (same seed; greedy and sampled) must give bitwise the same tokens and logprobs
(a) alone, (b) inside a batch of 16 mixed requests, (c) under block and slot shortage that forces
preemption and recomputation, (d) with zero-overhead scheduling on and off, (e) with chunked
prefill. Every block and slot must be free once everything has finished. On CUDA (marked ``gpu``)
a recomputed sequence's prompt runs as prefill chunks where its tokens first ran as graph decode
steps: the two forms must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.protocol import SamplingParams
from frontend.llm import LLM

LENGTHS = [5, 7, 9, 12, 15, 19, 23, 28, 34, 41, 50, 60, 72, 86, 102, 120]
BASE = dict(block_size=16, max_num_seqs=16, num_blocks=80, max_num_batched_tokens=512)
# 9 usable blocks of 16 tokens and 3 state slots: every request fits alone (at most 120 + 18 tokens),
# not together, so sequences are preempted and recomputed (checked through the engine's stats)
TIGHT = dict(BASE, num_blocks=10, num_state_slots=3)
TIGHT_REQUESTS = [4, 7, 11, 13, 14, 15]  # penalties, logprobs, min_tokens, the longest prompts
ALONE = [0, 4, 7, 11, 15]  # greedy, both penalised, top-k + logprobs, top-p + min-p with the longest prompt


def make_prompt(i: int, n: int) -> list[int]:
    return [3 + (7 + i * 37 + j * 11 + (j * j) % 13) % 1000 for j in range(n)]


def make_params(i: int) -> SamplingParams:
    max_tokens = 8 + (i * 5) % 13  # 8 .. 20
    kind = i % 4
    if i == 7:
        return SamplingParams(temperature=0.8, seed=7, presence_penalty=0.5, frequency_penalty=0.4,
                              repetition_penalty=1.3, max_tokens=20)
    if i == 4:  # a negative presence penalty makes the newest (still in-flight under ZOS) token matter
        return SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=0.2, max_tokens=max_tokens)
    if i == 11:
        return SamplingParams(temperature=0.9, top_k=50, seed=11, logprobs=3, max_tokens=max_tokens)
    if i == 13:
        return SamplingParams(temperature=0.0, logprobs=0, min_tokens=4, max_tokens=max_tokens)
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if kind == 1:
        return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens)
    if kind == 2:
        return SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=100 + i, max_tokens=max_tokens)
    return SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, seed=100 + i, max_tokens=max_tokens,
                          ignore_eos=True)


PROMPTS = [make_prompt(i, n) for i, n in enumerate(LENGTHS)]
PARAMS = [make_params(i) for i in range(len(LENGTHS))]


def signature(result) -> tuple:
    logprobs = None
    if result.logprobs is not None:
        logprobs = [(lp.token_id, lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in result.logprobs]
    return tuple(result.token_ids), result.finish_reason, logprobs


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def device(request) -> str:
    return request.param


def make_llm(checkpoint, device: str, **engine_args) -> LLM:
    if device == "cuda":  # asked for there; decode steps replay graphs, prefill and mixed steps run eagerly
        llm = LLM(str(checkpoint), device=device, batch_invariant=True, **engine_args)
        assert llm.engine.executor.runner.graphs is not None
    else:
        llm = LLM(str(checkpoint), device=device, **engine_args)
    assert llm.config.resolved_batch_invariant  # the CPU default
    return llm


def run_batch(checkpoint, device: str, indices=range(len(PROMPTS)), **engine_args):
    llm = make_llm(checkpoint, device, **engine_args)
    results = llm.generate([PROMPTS[i] for i in indices], [PARAMS[i] for i in indices], use_tqdm=False)
    stats = llm.engine.stats()
    assert not llm.engine.has_work
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and stats.running == stats.waiting == 0, stats
    return [signature(r) for r in results], stats


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint, device):
    sigs, stats = run_batch(tiny_checkpoint, device, **BASE)
    return sigs


def test_baseline_batch_is_sane(baseline):
    assert all(len(s[0]) <= p.max_tokens for s, p in zip(baseline, PARAMS))
    assert sum(len(s[0]) == p.max_tokens for s, p in zip(baseline, PARAMS)) >= 8
    assert all(reason in ("length", "stop") for _, reason, _ in baseline)
    assert len({s[0] for s in baseline}) == len(baseline)  # not a constant model
    lp = baseline[11][2]
    assert lp is not None and len(lp) == len(baseline[11][0])
    assert all(len(top) == 3 and tok == token for (tok, _, top, _), token in zip(lp, baseline[11][0]))
    assert all(len(top) == 0 for _, _, top, _ in baseline[13][2])
    assert all(len(s[0]) == PARAMS[i].max_tokens for i, s in enumerate(baseline) if PARAMS[i].ignore_eos)


def test_alone_equals_in_batch(tiny_checkpoint, device, baseline):
    llm = make_llm(tiny_checkpoint, device, **BASE)
    for i in ALONE:
        (result,) = llm.generate([PROMPTS[i]], [PARAMS[i]], use_tqdm=False)
        assert signature(result) == baseline[i], f"request {i} alone differs from request {i} in the batch"
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_sampling_depends_on_the_seed(tiny_checkpoint, device, baseline):
    """Guards the other tests against a sampler that ignores its noise (they would pass vacuously)."""
    llm = make_llm(tiny_checkpoint, device, **BASE)
    other = [SamplingParams(**{**{f: getattr(PARAMS[i], f) for f in PARAMS[i].__struct_fields__}, "seed": 999})
             for i in (1, 5)]
    results = llm.generate([PROMPTS[1], PROMPTS[5]], other, use_tqdm=False)
    assert any(tuple(r.token_ids) != baseline[i][0] for r, i in zip(results, (1, 5)))


def test_preemption_and_recomputation_give_the_same_tokens(tiny_checkpoint, device, baseline):
    assert max(LENGTHS[i] + PARAMS[i].max_tokens for i in TIGHT_REQUESTS) <= 9 * 16
    sigs, stats = run_batch(tiny_checkpoint, device, TIGHT_REQUESTS, **TIGHT)
    assert stats.preemptions > 0, "the tight configuration must actually preempt"
    assert stats.kv_blocks_total == 9 and stats.state_slots_total == 3
    assert [i for i, sig in zip(TIGHT_REQUESTS, sigs) if sig != baseline[i]] == []


def test_zos_off_gives_the_same_tokens(tiny_checkpoint, device, baseline):
    sigs, _ = run_batch(tiny_checkpoint, device, **dict(BASE, zos=False))
    assert [i for i in range(16) if sigs[i] != baseline[i]] == []


def test_chunked_prefill_gives_the_same_tokens(tiny_checkpoint, device, baseline):
    sigs, _ = run_batch(tiny_checkpoint, device, **dict(BASE, max_num_batched_tokens=32))
    assert [i for i in range(16) if sigs[i] != baseline[i]] == []


@pytest.mark.parametrize("engine_args", [dict(BASE, max_num_batched_tokens=64), dict(TIGHT, max_num_batched_tokens=64)],
                         ids=["chunked", "preempting"])
def test_mixed_steps_give_the_same_tokens(tiny_checkpoint, device, baseline, engine_args):
    """Decode rows beside prompt chunks (``--mixed-steps``): the same tokens, and such steps did run."""
    indices = TIGHT_REQUESTS if engine_args["num_blocks"] == TIGHT["num_blocks"] else range(16)
    llm = make_llm(tiny_checkpoint, device, mixed_steps=True, **engine_args)
    schedule, mixed = llm.engine.scheduler.schedule, []

    def recording_schedule():
        plan = schedule()
        rows = [s for batch in plan.ranks for s in batch.sequences] if plan is not None else []
        mixed.append(any(len(s.token_ids) > 1 for s in rows) and any(s.token_ids == [-1] for s in rows))
        return plan

    llm.engine.scheduler.schedule = recording_schedule
    results = llm.generate([PROMPTS[i] for i in indices], [PARAMS[i] for i in indices], use_tqdm=False)
    assert sum(mixed) >= 3
    assert [i for i, r in zip(indices, results) if signature(r) != baseline[i]] == []
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
