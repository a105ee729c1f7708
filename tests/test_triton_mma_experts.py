"""The routed experts on the tensor cores fed from registers (``model/kernels/triton_mma_experts.py``)
against the reference arithmetic, in Triton's interpreter at tiny shapes (on CUDA: the same shapes on
the GPU). In the interpreter a twin made of tensor operations computes the tensor-core instruction over
the same per-lane fragments, so the lanes' addressing is what is tested there; the inline PTX itself is
executed lane by lane by ``tests/ptx_warp.py`` below.

Tolerance: ``assert_experts_close_to_reference``, as for ``triton_moe`` (``test_triton_kernels.py``'s
docstring derives it): the products are exact and only the order of the fp32 sums differs.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.config import WeightFormat  # noqa: E402
from model.kernels import ExpertWeights, QuantizedWeight, tile_configs, triton_split_sums  # noqa: E402
from model.kernels import triton_mma_experts  # noqa: E402
from model.kernels.fp4_fragments import fragment_column_order, to_fragments  # noqa: E402
from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.kernels.triton_mma_experts import mma_experts  # noqa: E402
from tests.kernel_checks import device  # noqa: E402
from tests.ptx_warp import bits32, f32, run_warp_ptx  # noqa: E402
from tests.test_triton_kernels import assert_experts_close_to_reference, random_weight  # noqa: E402

REFERENCE = ReferenceKernels(batch_invariant=False)


def _config(monkeypatch, warps: int, programs_per_sm: int, max_splits: int = 64, sms: int = 132) -> None:
    cfg = tile_configs.DecodeConfig(32 * warps, 64, warps, 1, programs_per_sm, max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_MMA_EXPERTS_TABLE", ((1 << 62, cfg),))
    monkeypatch.setattr(triton_mma_experts, "sm_count", lambda device: sms)


def _experts(num: int, d: int, inter: int, gen: torch.Generator, fragments: bool = True) -> ExpertWeights:
    from model.kernels.triton_backend import TritonKernels

    experts = ExpertWeights(random_weight(WeightFormat.FP4, inter, d, gen, num),
                            random_weight(WeightFormat.FP4, inter, d, gen, num),
                            random_weight(WeightFormat.FP4, d, inter, gen, num), first_expert=0, swiglu_limit=1.0)
    return TritonKernels().prepare_experts(experts) if fragments else experts


def _pairs(tokens: int, top_k: int, num: int, gen: torch.Generator):
    ids = torch.rand(tokens, num, generator=gen).topk(top_k, dim=-1).indices.reshape(-1)
    pair_token = torch.arange(tokens * top_k) // top_k
    weights = torch.rand(tokens * top_k, generator=gen) * 2
    return pair_token, ids, weights


@pytest.mark.parametrize("tokens,top_k,num,d,inter,warps,programs_per_sm,max_splits", [
    (1, 2, 4, 128, 128, 1, 1, 1),  # one token, one warp, one split of 2 steps: the down lanes store bf16
    (11, 3, 6, 128, 128, 4, 64, 64),  # every 64-column step a split in both kernels; warps past w2's rows
    (20, 2, 4, 384, 128, 4, 4, 2),  # ~10 pairs per expert (two blocks each); splits of 3 steps, and of 1
    (3, 2, 4, 384, 256, 4, 1, 1),  # one split of 6 steps (gate/up) and of 4 (down)
])
def test_matches_reference(monkeypatch, tokens, top_k, num, d, inter, warps, programs_per_sm, max_splits):
    _config(monkeypatch, warps, programs_per_sm, max_splits)
    gen = torch.Generator().manual_seed(tokens * 100 + d + inter)
    experts = _experts(num, d, inter, gen)
    pair_token, ids, weights = _pairs(tokens, top_k, num, gen)
    if tokens > 1:
        ids[[0, 3]] = torch.tensor([-1, num + 2])  # pairs another rank owns: their rows stay zero
    x = torch.randn(tokens, d, generator=gen).bfloat16()
    ref = REFERENCE.expert_outputs(x, pair_token, ids, weights, experts)
    on = experts.to(device())
    args = (x.to(device()), pair_token.to(device()), ids.to(device()), weights.to(device()), on)
    got = mma_experts(*args).cpu()
    if tokens > 1:
        assert got[[0, 3]].abs().max() == 0
    assert_experts_close_to_reference(got, ref)
    assert torch.equal(mma_experts(*args).cpu(), got)
    # the last split of each tile added the partials and set its counter back to zero
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


def test_a_pairs_outputs_do_not_depend_on_the_rest_of_its_block(monkeypatch):
    """Same split, same bits: a token alone or with 15 others (two blocks of one expert here)."""
    _config(monkeypatch, 2, 1, max_splits=1)
    gen = torch.Generator().manual_seed(9)
    experts = _experts(2, 128, 128, gen).to(device())
    x = torch.randn(16, 128, generator=gen).bfloat16().to(device())
    pair_token = torch.arange(16, device=device())
    ids = torch.zeros(16, dtype=torch.int64, device=device())  # every token on expert 0
    weights = torch.rand(16, generator=gen).to(device())
    together = mma_experts(x, pair_token, ids, weights, experts)
    for token in (0, 9, 15):
        alone = mma_experts(x[token:token + 1], pair_token[:1], ids[:1], weights[token:token + 1], experts)
        assert torch.equal(alone, together[token:token + 1])


@pytest.mark.parametrize("max_splits", [1, 4])
def test_a_step_of_few_pairs_skips_the_sort_with_the_same_bits(monkeypatch, max_splits):
    """Up to ``MMA_EXPERTS_UNSORTED_PAIRS`` pairs each pair is a block of its own, no sort: the same bits
    as the sorted blocks, with two pairs of one expert and two of no local expert (their rows zero),
    whether the down kernel's lanes store bf16 themselves (one split) or through its partials."""
    _config(monkeypatch, 2, 4, max_splits=max_splits)
    gen = torch.Generator().manual_seed(31 + max_splits)
    experts = _experts(4, 128, 256, gen).to(device())
    x = torch.randn(3, 128, generator=gen).bfloat16().to(device())
    pair_token = torch.tensor([0, 0, 1, 1, 2, 2], device=device())
    ids = torch.tensor([2, 0, 2, -1, 3, 7], device=device())
    weights = torch.rand(6, generator=gen).to(device())
    assert tile_configs.MMA_EXPERTS_UNSORTED_PAIRS == 8  # a one-token step of top-6 or top-8
    sorts = []
    real_sort = triton_mma_experts.align_pairs
    monkeypatch.setattr(triton_mma_experts, "align_pairs", lambda *a, **kw: sorts.append(1) or real_sort(*a, **kw))
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_UNSORTED_PAIRS", 0)
    sorted_ = mma_experts(x, pair_token, ids, weights, experts)
    assert sorts == [1]
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_UNSORTED_PAIRS", 8)
    stale = torch.full_like(sorted_, float("nan"))  # the output's memory as another kernel left it
    monkeypatch.setattr(torch, "empty", _first_call_returns(torch.empty, stale))
    unsorted = mma_experts(x, pair_token, ids, weights, experts)
    assert sorts == [1] and unsorted.data_ptr() == stale.data_ptr()
    assert torch.equal(unsorted, sorted_)
    assert unsorted[[3, 5]].abs().max() == 0 and unsorted[[0, 1, 2, 4]].abs().min() > 0


def _first_call_returns(empty, result):
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        return result if len(calls) == 1 else empty(*args, **kwargs)
    return patched


def test_backend_takes_it_up_to_its_pairs_per_expert(monkeypatch):
    """Steps with at most ``MMA_EXPERTS_MAX_PAIRS`` pairs per expert on average take these kernels, equal
    to calling them directly; beyond, in the batch-invariant mode, for experts in the checkpoint's rows,
    and with the bound at 0, ``triton_moe``."""
    from model.kernels.triton_backend import TritonKernels

    _config(monkeypatch, 1, 4)
    gen = torch.Generator().manual_seed(5)
    experts = _experts(4, 128, 128, gen).to(device())
    rows = _experts(4, 128, 128, gen, fragments=False).to(device())
    x = torch.randn(4, 128, generator=gen).bfloat16().to(device())
    pair_token, ids, weights = (t.to(device()) for t in _pairs(4, 2, 4, gen))  # 2 pairs per expert
    calls = []
    real = triton_mma_experts.mma_experts
    monkeypatch.setattr(triton_mma_experts, "mma_experts",
                        lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    assert tile_configs.MMA_EXPERTS_MAX_PAIRS == 4.0  # measured up to 4 pairs per expert: docs/benchmarks-log.md
    kernels = TritonKernels()
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", 0.0)
    kernels.expert_outputs(x, pair_token, ids, weights, experts)
    assert calls == []
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", 2.0)
    got = kernels.expert_outputs(x, pair_token, ids, weights, experts)
    assert calls == [8]
    assert torch.equal(got, real(x, pair_token, ids, weights, experts))
    calls.clear()
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", 1.9)
    kernels.expert_outputs(x, pair_token, ids, weights, experts)
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", 2.0)
    TritonKernels(batch_invariant=True).expert_outputs(x, pair_token, ids, weights, experts)
    kernels.expert_outputs(x, pair_token, ids, weights, rows)
    assert calls == []


def test_rejects_experts_it_does_not_read():
    gen = torch.Generator().manual_seed(0)
    rows = _experts(2, 64, 64, gen, fragments=False)
    assert not triton_mma_experts.takes(rows)
    experts = _experts(2, 128, 128, gen)
    assert triton_mma_experts.takes(experts)
    buffer = torch.empty(experts.w2.values.numel() + 4, dtype=torch.uint8)
    shifted = buffer[4:].view(experts.w2.values.shape)  # a view starting off an 8-byte boundary
    shifted.copy_(experts.w2.values.view(torch.uint8))
    experts.w2 = QuantizedWeight(shifted.view(experts.w2.values.dtype), experts.w2.scales, experts.w2.fmt,
                                 fragments=True)
    assert not triton_mma_experts.takes(experts)
    with pytest.raises(ValueError, match="fragment layout"):
        mma_experts(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
                    torch.zeros(1, dtype=torch.int64), torch.ones(1), rows)


def test_activation_rows_in_the_fragment_column_order():
    from model.kernels.triton_scaled_mm import act_quant_bf16

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 192, generator=gen) * 3).bfloat16().to(device())
    plain = act_quant_bf16(x)
    permuted = act_quant_bf16(x, fragment_columns=True)
    order = fragment_column_order(192).to(device())
    assert torch.equal(permuted[:, order], plain)
    assert sorted(order.tolist()) == list(range(192))
    with pytest.raises(ValueError, match="K % 64"):
        act_quant_bf16(x[:, :96], fragment_columns=True)


def test_tile_step_ptx_computes_a_groups_products_lane_by_lane():
    """``_TILE_STEP_PTX`` with each lane's operands laid out as the kernels load them (its four words of a
    16-row group, the group's two scale pairs, pair g's activation in the fragment column order)
    returns, in lane (g, t), the running sums plus the products of rows g and g + 8 with pairs 2t and
    2t + 1 over the step's 64 columns."""
    gen = torch.Generator().manual_seed(0)
    w = random_weight(WeightFormat.FP4, 16, 64, gen)
    dense = w.dequantized(torch.float32).double()  # [16, 64]
    values, scales = to_fragments(w.values, w.scales)
    words = values.view(torch.uint8).reshape(8, 4, 16)  # [g, t, the lane's 16 bytes]
    pairs = scales.view(torch.uint8).reshape(2, 8, 2)  # [block, g, h]
    act = torch.randn(8, 64, generator=gen).bfloat16()
    permuted = torch.empty_like(act)
    permuted[:, fragment_column_order(64)] = act
    start = torch.randn(32, 4, generator=gen)

    def word64(chunk: torch.Tensor) -> int:
        return int(chunk.contiguous().view(torch.int64).item()) & (2 ** 64 - 1)

    def pair16(block: int, g: int) -> int:
        return int(pairs[block, g, 0]) | int(pairs[block, g, 1]) << 8

    lanes = [(lane >> 2, lane % 4) for lane in range(32)]
    act_bytes = permuted.view(torch.uint8).reshape(8, 4, 4, 8)  # [pair, t, c, 4 bf16]
    operands = [
        [word64(words[g, t, :8]) for g, t in lanes],
        [word64(words[g, t, 8:]) for g, t in lanes],
        [pair16(0, g) for g, t in lanes],
        [pair16(1, g) for g, t in lanes],
        *[[word64(act_bytes[g, t, c]) for g, t in lanes] for c in range(4)],
        *[[bits32(start[lane, j].item()) for lane in range(32)] for j in range(4)],
    ]
    got = run_warp_ptx(triton_mma_experts._TILE_STEP_PTX.value, operands, 4)
    products = dense @ act.double().T  # [16 rows, 8 pairs]
    for lane, (g, t) in enumerate(lanes):
        expected = [start[lane, 0] + products[g, 2 * t], start[lane, 1] + products[g, 2 * t + 1],
                    start[lane, 2] + products[g + 8, 2 * t], start[lane, 3] + products[g + 8, 2 * t + 1]]
        for j in range(4):
            assert f32(got[lane][j]) == pytest.approx(float(expected[j]), rel=1e-6, abs=1e-6), (lane, j)
