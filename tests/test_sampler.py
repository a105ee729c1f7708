"""Tests of the batched deterministic sampler (workers/sampler.py, sampling_noise.py)."""

from __future__ import annotations

import math
import random

import pytest
import numpy as np
import torch

from workers import sampler as sampler_mod
from workers import sampling_noise as noise
from workers.sampler import (
    RowSpec,
    SamplingBatch,
    SamplingParams,
    apply_penalties_and_bias,
    prompt_logprobs,
    random_seed,
    sample,
)

CUDA = torch.cuda.is_available()


def run(logits: torch.Tensor, rows: list[RowSpec], device: str = "cpu"):
    batch = SamplingBatch.build(rows, logits.shape[1], device)
    return sample(logits.to(device), batch)


def chi2_critical(dof: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.29: p ~ 5e-4)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 20000, seed: int = 1234) -> torch.Tensor:
    """Sample one logits vector at n different positions (one row per position)."""
    rows = [RowSpec(params, seed, pos) for pos in range(n)]
    out = run(logits_row.expand(n, -1).contiguous(), rows)
    return torch.bincount(out.token_ids, minlength=logits_row.numel())


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Tokens with probability 0 never appear; the rest fit probs by a chi-square test."""
    allowed = probs > 0
    assert int(counts[~allowed].sum()) == 0, f"excluded tokens drawn: {counts.tolist()}"
    n = counts.sum().item()
    expected = probs[allowed].double() * n
    stat = (((counts[allowed].double() - expected) ** 2) / expected).sum().item()
    dof = int(allowed.sum()) - 1
    if dof > 0:
        assert stat < chi2_critical(dof), f"chi2={stat:.1f} counts={counts.tolist()} probs={probs.tolist()}"


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ignores_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 97, generator=g)
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    a = run(logits, [RowSpec(greedy, seed=i, position=i) for i in range(6)])
    b = run(logits, [RowSpec(greedy, seed=1000 + i, position=7) for i in range(6)])
    assert torch.equal(a.token_ids, logits.argmax(-1))
    assert torch.equal(a.token_ids, b.token_ids)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    out = run(logits, [RowSpec(SamplingParams(temperature=0.0), 1, 0)] * 2)
    assert out.token_ids.tolist() == [1, 0]


# ---------------------------------------------------------------- determinism


def _mixed_rows() -> list[RowSpec]:
    P = SamplingParams
    specs = [
        P(),
        P(temperature=0.0),
        P(temperature=0.7, top_k=20),
        P(temperature=1.3, top_p=0.8),
        P(min_p=0.05),
        P(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02),
        P(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={3: 2.0}),
        P(temperature=2.0, logprobs=4),
    ]
    return [
        RowSpec(p, seed=11 * i + 5, position=100 + 3 * i, prompt_token_ids=[1, 2, 3, i], output_token_ids=[3, 3, 7 + i])
        for i, p in enumerate(specs)
    ]


def test_same_token_whatever_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=g) * 3
    rows = _mixed_rows()
    full = run(logits, rows).token_ids

    assert torch.equal(run(logits, rows).token_ids, full)  # repeated call
    for perm in ([7, 6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 1, 7, 2, 5, 4]):
        out = run(logits[perm], [rows[i] for i in perm]).token_ids
        assert torch.equal(out, full[perm])
    for i in range(8):  # each row alone: its filters/penalties flags differ from the batch's
        assert run(logits[i : i + 1], [rows[i]]).token_ids.item() == full[i].item()
    sub = [5, 2]
    assert torch.equal(run(logits[sub], [rows[i] for i in sub]).token_ids, full[sub])
    # A row duplicated in the same batch gets the same token: no dependence on row index.
    dup = run(logits[[4, 4, 4]], [rows[4]] * 3).token_ids
    assert dup.tolist() == [full[4].item()] * 3


def test_noise_chunking_does_not_change_tokens(monkeypatch):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=g)
    rows = _mixed_rows()
    full = run(logits, rows).token_ids
    monkeypatch.setattr(sampler_mod, "_NOISE_CHUNK_ELEMENTS", 2 * 300)
    assert torch.equal(run(logits, rows).token_ids, full)


def test_positions_and_seeds_change_the_draw():
    logits = torch.zeros(64, 1000)  # uniform: every draw is pure noise
    p = SamplingParams()
    a = run(logits, [RowSpec(p, 1, pos) for pos in range(64)]).token_ids
    b = run(logits, [RowSpec(p, 2, pos) for pos in range(64)]).token_ids
    assert len(set(a.tolist())) > 55  # ~62 expected distinct values out of 1000
    assert (a != b).sum() > 55


def test_seed_edge_values():
    # Negative and >64-bit seeds are taken modulo 2**64; none may raise.
    logits = torch.zeros(3, 50)
    rows = [RowSpec(SamplingParams(), s, 9) for s in (-1, 2**64 - 1, 2**70 + 5)]
    out = run(logits, rows).token_ids
    assert out[0] == out[1]  # -1 == 2**64 - 1 (mod 2**64)
    assert 0 <= random_seed() < 2**63


# ---------------------------------------------------------------- distributions


def test_distribution_matches_softmax_with_temperature():
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.5]])
    for t in (1.0, 0.6, 1.8):
        counts = draw_many(logits, SamplingParams(temperature=t))
        assert_matches(counts, torch.softmax(logits[0] / t, -1))


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def _renorm(probs: list[float], keep: list[int]) -> torch.Tensor:
    p = torch.tensor(probs, dtype=torch.float64)
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[keep] = True
    p = torch.where(mask, p, 0.0)
    return p / p.sum()


def test_top_k():
    probs = [0.1, 0.3, 0.05, 0.25, 0.2, 0.1]
    counts = draw_many(_probs_logits(probs), SamplingParams(top_k=3))
    assert_matches(counts, _renorm(probs, [1, 3, 4]))


def test_top_k_tie_at_cut_keeps_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    counts = draw_many(logits, SamplingParams(top_k=1), n=500)
    assert counts.tolist() == [0, 500, 0, 0]


def test_top_p():
    probs = [0.15, 0.5, 0.1, 0.25]
    # Sorted 0.5, 0.25, 0.15, 0.1: cumulative 0.5, 0.75 >= 0.7 -> keep {1, 3}.
    assert_matches(draw_many(_probs_logits(probs), SamplingParams(top_p=0.7)), _renorm(probs, [1, 3]))
    # top_p below the top prob still keeps the top token.
    assert_matches(draw_many(_probs_logits(probs), SamplingParams(top_p=0.1), n=500), _renorm(probs, [1]))


def test_min_p():
    probs = [0.15, 0.5, 0.1, 0.25]
    # threshold 0.35 * 0.5 = 0.175 -> keep {1, 3}; 0.25 * 0.5 = 0.125 -> keep {0, 1, 3}.
    assert_matches(draw_many(_probs_logits(probs), SamplingParams(min_p=0.35)), _renorm(probs, [1, 3]))
    assert_matches(draw_many(_probs_logits(probs), SamplingParams(min_p=0.25)), _renorm(probs, [0, 1, 3]))


def test_top_k_is_applied_before_top_p():
    probs = [0.3, 0.25, 0.2, 0.12, 0.08, 0.05]
    # After top-k=4 the mass is 0.87: renormalised 0.345, 0.287, ... -> top_p=0.6 keeps {0, 1}.
    # (top-p first would have kept {0, 1, 2}.)
    counts = draw_many(_probs_logits(probs), SamplingParams(top_k=4, top_p=0.6))
    assert_matches(counts, _renorm(probs, [0, 1]))


def test_filters_with_temperature():
    probs = [0.4, 0.3, 0.2, 0.1]
    t = 0.5  # sharpen: p^2 -> 0.16, 0.09, 0.04, 0.01 (/0.3) = 0.533, 0.3, 0.133, 0.033
    counts = draw_many(_probs_logits(probs), SamplingParams(temperature=t, top_p=0.8))
    sharp = [q**2 for q in probs]
    assert_matches(counts, _renorm(sharp, [0, 1]))


# ---------------------------------------------------------------- the hash


def test_hash_matches_plain_python_twin():
    rnd = random.Random(0)
    xs = [0, 1, 2**31, 2**32 - 1] + [rnd.getrandbits(32) for _ in range(2000)]
    got = noise.mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [noise.mix32_int(x) for x in xs]
    seeds = [0, -1, 2**63 - 1, 2**64 + 17, rnd.getrandbits(64)]
    positions = [0, 1, 4096, 2**32 - 1]
    pairs = [(s, p) for s in seeds for p in positions]
    words = [noise.split_seed(s) for s, _ in pairs]
    keys = noise.row_keys(
        torch.tensor([w[0] for w in words]), torch.tensor([w[1] for w in words]), torch.tensor([p for _, p in pairs])
    )
    assert keys.tolist() == [noise.row_key_int(s, p) for s, p in pairs]
    # the sampling batch computes its keys on numpy arrays: the same values
    as_numpy = noise.row_keys(np.array([w[0] for w in words]), np.array([w[1] for w in words]),
                              np.array([p for _, p in pairs]))
    assert as_numpy.tolist() == keys.tolist()


def test_uniform_is_open_interval_and_uniform():
    extremes = noise.bits_to_uniform(torch.tensor([0, 2**32 - 1]))
    assert 0.0 < extremes[0] < 1e-9 and 1.0 - 1e-9 < extremes[1] < 1.0
    keys = noise.row_keys(torch.full((256,), 7), torch.zeros(256, dtype=torch.int64), torch.arange(256))
    bits = noise.hash_bits(keys, noise.token_mix(4096, torch.device("cpu")))
    u = noise.bits_to_uniform(bits)
    assert bits.min() >= 0 and bits.max() <= noise.MASK32
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 2e-3
    # Each of the 32 bits is set about half of the time.
    ones = torch.stack([((bits >> i) & 1).double().mean() for i in range(32)])
    assert (ones - 0.5).abs().max() < 5e-3
    # Neighbouring positions (same token) and neighbouring tokens (same position) are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 5e-3


# ---------------------------------------------------------------- penalties, bias


def test_penalties_and_bias_hand_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0], [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={5: 1.5, "0": -1.0}
    )
    rows = [
        RowSpec(params, 1, 5, prompt_token_ids=[0, 1], output_token_ids=[2, 2, 3]),
        RowSpec(SamplingParams(), 1, 5, prompt_token_ids=[0, 1], output_token_ids=[2, 2, 3]),
    ]
    batch = SamplingBatch.build(rows, 6, "cpu")
    out = apply_penalties_and_bias(logits, batch)
    # repetition over {0,1,2,3} (prompt + output): 1.0, -2.0, 0.25, -1.0
    # frequency over output counts {2: 2, 3: 1}: t2 -= 1.0, t3 -= 0.5
    # presence over output {2, 3}: -= 0.25 each; bias: t5 += 1.5, t0 -= 1.0
    assert out[0].tolist() == [0.0, -2.0, -1.0, -1.75, 3.0, 1.5]
    assert torch.equal(out[1], logits[1])  # neutral row untouched bit for bit
    assert logits[0, 0] == 2.0  # input not modified


def test_penalised_greedy_uses_processed_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    rows = [RowSpec(SamplingParams(temperature=0.0, presence_penalty=0.5), 0, 3, output_token_ids=[0])]
    assert run(logits, rows).token_ids.tolist() == [1]
    rows = [RowSpec(SamplingParams(temperature=0.0, logit_bias={2: 10.0}), 0, 3)]
    assert run(logits, rows).token_ids.tolist() == [2]


def test_empty_batch():
    # Ranks without work still run every step (DESIGN.md: placeholder batches).
    out = run(torch.empty(0, 10), [])
    assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,) and out.top_logprobs is None


def test_invalid_inputs_raise():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingBatch.build([RowSpec(SamplingParams(logit_bias={10: 1.0}), 0, 0)], 10, "cpu")
    with pytest.raises(ValueError):
        SamplingBatch.build([RowSpec(SamplingParams(repetition_penalty=1.1), 0, 0, prompt_token_ids=[10])], 10, "cpu")


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=g) * 2
    rows = _mixed_rows()
    rows[0] = RowSpec(SamplingParams(logprobs=1, temperature=0.5), 3, 4)
    out = run(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (8, 4) and out.top_logprob_ids.shape == (8, 4)
    vals, ids = ref.topk(4, dim=-1)
    assert torch.equal(out.top_logprobs, vals) and torch.equal(out.top_logprob_ids, ids)
    none = run(logits[:1], [RowSpec(SamplingParams(logprobs=0), 0, 0)])
    assert none.top_logprobs is None and none.top_logprob_ids is None


def test_prompt_logprobs_hand_example():
    logits = torch.tensor([[0.0, math.log(2), math.log(5)], [math.log(6), math.log(3), 0.0]])
    res = prompt_logprobs(logits, torch.tensor([1, 2]), 2)
    torch.testing.assert_close(res.token_logprobs, torch.tensor([math.log(0.25), math.log(0.1)]))
    assert res.top_ids.tolist() == [[2, 1], [0, 1]]
    expected_top = torch.tensor([[math.log(0.625), math.log(0.25)], [math.log(0.6), math.log(0.3)]])
    torch.testing.assert_close(res.top_logprobs, expected_top)
    assert prompt_logprobs(logits, torch.tensor([0, 0]), 0).top_ids.shape == (2, 0)


# ---------------------------------------------------------------- devices


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cpu_and_cuda_agree():
    dev = torch.device("cuda")
    mixed = noise.token_mix(129280, dev)
    assert torch.equal(mixed.cpu(), noise.token_mix(129280, torch.device("cpu")))
    keys = torch.tensor([noise.row_key_int(s, p) for s, p in [(0, 0), (-5, 77), (2**63 - 1, 10**6)]])
    assert torch.equal(noise.hash_bits(keys.to(dev), mixed).cpu(), noise.hash_bits(keys, mixed.cpu()))

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 300, generator=g) * 3
    rows = _mixed_rows()
    cpu, gpu = run(logits, rows), run(logits, rows, "cuda")
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    big = torch.randn(64, 129280, generator=g) * 4
    big_rows = [RowSpec(SamplingParams(temperature=0.8, top_p=0.95), 9, 1000 + i) for i in range(64)]
    assert torch.equal(run(big, big_rows).token_ids, run(big, big_rows, "cuda").token_ids.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_rows_without_top_logprobs_agree_with_cpu():
    """CUDA reduces the rows with ``triton_greedy`` (no log_softmax): the same
    greedy and sampled tokens as the CPU. The chosen logprob ``x - lse`` is judged against float64: its
    error is the rounding of ``lse = M + log(S)`` and of the subtraction (an ulp of ``|lse|`` each,
    ~20 here), ``log``'s (an ulp) and the relative error of the tree-summed ``S`` (the chunks' 4,096
    terms and 32 chunks: ~log2(V) roundings of 2**-24); a bound of 4 ulps of ``|lse|`` plus
    ``log2(V) * 2**-24`` (~8.6e-6; the kernel in the interpreter: 8e-7). Not against the CPU's logprobs:
    its fp32 log_softmax is itself up to 1.8e-5 off float64 on these rows."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 129280, generator=g) * 4
    rows = [RowSpec(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i), 3, 50 + i) for i in range(8)]
    cpu, gpu = run(logits, rows), run(logits, rows, "cuda")
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    exact_lse = torch.logsumexp(logits.double(), dim=-1)
    exact = logits.double().gather(1, cpu.token_ids[:, None]).squeeze(1) - exact_lse
    bound = 4 * torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(exact_lse.abs())) \
        + math.log2(logits.shape[1]) * 2.0 ** -24
    assert ((gpu.logprobs.cpu().double() - exact).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_logprobs_do_not_depend_on_the_other_rows():
    """A row's logprob on CUDA is the same bits whether or not another row of its step asks for top
    logprobs (the whole step took torch's log_softmax then, a few ulps from ``x - lse``, which made the
    engine's determinism tests fail on CUDA); a top list holds the chosen token's logprob exactly."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(9, 129280, generator=g) * 4
    wants_top = 1  # the one row that asks for top logprobs; the others are greedy or sampled without
    rows = [RowSpec(SamplingParams(temperature=0.0, logprobs=3 if i == wants_top else 0), i, 10 + i)
            for i in range(6)]
    rows += [RowSpec(SamplingParams(temperature=0.9, seed=i, logprobs=0), i, 10 + i) for i in range(6, 9)]
    alone = [run(logits[i:i + 1], [row], "cuda") for i, row in enumerate(rows)]
    together = run(logits, rows, "cuda")
    for i in range(len(rows)):  # several rows: a few-ulp difference cannot hide in all of them
        assert together.token_ids[i] == alone[i].token_ids[0]
        assert torch.equal(together.logprobs[i:i + 1], alone[i].logprobs), i
    assert torch.equal(together.top_logprobs[wants_top], alone[wants_top].top_logprobs[0])
    # greedy: its token heads the list, with the chosen token's logprob bit for bit
    assert together.top_logprob_ids[wants_top, 0] == together.token_ids[wants_top]
    assert together.top_logprobs[wants_top, 0] == together.logprobs[wants_top]
    exact = torch.log_softmax(logits[wants_top].double(), dim=-1).topk(3)
    assert torch.equal(together.top_logprob_ids[wants_top].cpu(), exact.indices)
    assert torch.allclose(together.top_logprobs[wants_top].cpu().double(), exact.values, rtol=0, atol=1e-5)
