"""A few tokens' FP8 products on the tensor cores (``model/kernels/triton_mma_gemv.py``) against the
reference arithmetic, in Triton's interpreter at tiny shapes (on CUDA: the same shapes on the GPU,
where the tensor-core instruction itself runs; in the interpreter a twin made of tensor operations
computes it over the same per-lane fragments, so the lanes' addressing is what is tested there).

Tolerance: ``assert_close_to_reference`` (one bf16 ulp of the value plus 2**-16 of the row's largest
output), as for ``triton_gemv``: the products are exact and only the order of the fp32 sums inside a
32-column block differs from the reference's (``test_triton_kernels.py``'s docstring derives the bound).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.config import WeightFormat  # noqa: E402
from model.kernels import tile_configs, triton_gemv, triton_mma_gemv, triton_split_sums  # noqa: E402
from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.kernels.triton_mma_gemv import fp8_mma_gemv  # noqa: E402
from tests.kernel_checks import device  # noqa: E402
from tests.ptx_warp import bits32, f32, run_warp_ptx  # noqa: E402
from tests.test_triton_kernels import assert_close_to_reference, random_weight  # noqa: E402

REFERENCE = ReferenceKernels(batch_invariant=False)


def _config(monkeypatch, warps: int, programs_per_sm: int, max_splits: int = 64, sms: int = 132,
            step_blocks: int = 1) -> None:
    cfg = tile_configs.DecodeConfig(32 * warps, 32 * step_blocks, warps, 1, programs_per_sm, max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_TABLE", ((8, cfg),))
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_BY_SHAPE", {})
    monkeypatch.setattr(triton_mma_gemv, "sm_count", lambda device: sms)


@pytest.mark.parametrize("m,n,k,warps,programs_per_sm,max_splits,step_blocks", [
    (1, 64, 256, 2, 1, 64, 1),  # one split: the bf16 output stored by the lanes themselves
    (1, 96, 320, 2, 64, 64, 1),  # every block a split; the second program's second warp past the last row
    (3, 128, 384, 4, 64, 5, 1),  # an odd token count, splits of 3, 3, 3, 3 blocks
    (8, 160, 256, 1, 4, 3, 1),  # every token column in use, one warp per program, splits of 3, 3 and 2
    (5, 32, 96, 1, 1, 64, 1),  # three blocks, one warp, one split
    (1, 64, 384, 2, 1, 64, 2),  # two blocks per step: 6 steps in one split
    (2, 96, 640, 1, 64, 3, 2),  # two blocks per step, splits of 4, 4 and 2 steps
    (1, 64, 96, 2, 4, 64, 2),  # K of three blocks: one block per step after all
    (1, 64, 512, 2, 1, 64, 4),  # four blocks per step: 4 steps in one split (two loop iterations)
    (6, 96, 1536, 1, 64, 3, 4),  # four blocks per step, splits of 4, 4 and 4 steps
    (2, 64, 192, 2, 1, 64, 4),  # K of six blocks: two blocks per step after all
])
def test_one_weight_matches_reference(monkeypatch, m, n, k, warps, programs_per_sm, max_splits, step_blocks):
    _config(monkeypatch, warps, programs_per_sm, max_splits, step_blocks=step_blocks)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = random_weight(WeightFormat.FP8, n, k, gen)
    # token scales spread over 2**-6 .. 2**6 (each row's own), e4m3 subnormals in every block
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-6, 6, m, base=2.0)[:, None]).bfloat16()
    ref = REFERENCE.quantized_linear(x, weight)
    on = weight.to(device())
    got = fp8_mma_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu()
    assert got.shape == (m, n)
    assert_close_to_reference(got, ref)
    assert torch.equal(fp8_mma_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu(), got)
    # the last split of each tile added the partials and set its counter back to zero
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


@pytest.mark.parametrize("prep_blocks", [1, 2, 16])
def test_the_activation_prepared_in_steps_of_any_length(monkeypatch, prep_blocks):
    """The activation's preparation walks a split's 20 blocks in steps of 1, 2 or 16 blocks (the last step of
    16 four blocks long, its rest masked): the same bits each way, close to the reference."""
    _config(monkeypatch, 2, 1, max_splits=1)
    gen = torch.Generator().manual_seed(11)
    weight = random_weight(WeightFormat.FP8, 64, 640, gen)
    x = torch.randn(5, 640, generator=gen).bfloat16()
    ref = REFERENCE.quantized_linear(x, weight)  # first: .to(device) moves the weight
    on = weight.to(device())
    monkeypatch.setattr(triton_mma_gemv, "PREP_BLOCKS", 4)
    four = fp8_mma_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu()
    monkeypatch.setattr(triton_mma_gemv, "PREP_BLOCKS", prep_blocks)
    got = fp8_mma_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu()
    assert torch.equal(got, four)
    assert_close_to_reference(got, ref)


def test_each_token_is_its_own_row_of_the_output(monkeypatch):
    """A token's outputs do not depend on which other tokens share its launch (same split: same bits)."""
    _config(monkeypatch, 2, 4)
    gen = torch.Generator().manual_seed(7)
    weight = random_weight(WeightFormat.FP8, 64, 256, gen).to(device())
    x = torch.randn(8, 256, generator=gen).bfloat16().to(device())
    together = fp8_mma_gemv(x, [(weight.values, weight.scales)], quantize=True)
    for row in (0, 5, 7):
        alone = fp8_mma_gemv(x[row:row + 1], [(weight.values, weight.scales)], quantize=True)
        assert torch.equal(together[row:row + 1], alone)


def test_a_launch_takes_the_config_of_its_shape(monkeypatch):
    """``tile_configs._MMA_GEMV_BY_SHAPE`` is keyed by a launch's output rows (a second weight's N added)
    and its K, each shape's rows bounded by M like the table's; other shapes and M's take the table."""
    _config(monkeypatch, 2, 1)
    shaped = tile_configs.DecodeConfig(32, 64, 1, 1, 64)
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_BY_SHAPE", {(64 + 96, 256): ((4, shaped),)})
    used = []
    real = triton_mma_gemv.split_count
    monkeypatch.setattr(triton_mma_gemv, "split_count", lambda cfg, *args: used.append(cfg) or real(cfg, *args))
    gen = torch.Generator().manual_seed(13)
    first, second = random_weight(WeightFormat.FP8, 64, 256, gen), random_weight(WeightFormat.FP8, 96, 256, gen)
    xs = [torch.randn(m, 256, generator=gen).bfloat16() for m in (3, 5)]
    refs = [(REFERENCE.quantized_linear(x, first), REFERENCE.quantized_linear(x, second)) for x in xs]
    on_first, on_second = first.to(device()), second.to(device())
    for x, (ref_first, ref_second) in zip(xs, refs, strict=True):
        both = fp8_mma_gemv(x.to(device()), [(on_first.values, on_first.scales), (on_second.values, on_second.scales)],
                            quantize=True)
        fp8_mma_gemv(x.to(device()), [(on_first.values, on_first.scales)], quantize=True)
        assert_close_to_reference(both[:, :64].cpu(), ref_first)
        assert_close_to_reference(both[:, 64:].cpu(), ref_second)
    assert [cfg.num_warps for cfg in used] == [1, 2, 2, 2]  # the pair's shape up to 4 tokens only


def test_two_weights_in_one_launch_match_each_alone(monkeypatch):
    _config(monkeypatch, 2, 1)
    gen = torch.Generator().manual_seed(11)
    first, second = random_weight(WeightFormat.FP8, 64, 256, gen), random_weight(WeightFormat.FP8, 160, 256, gen)
    x = torch.randn(2, 256, generator=gen).bfloat16()
    refs = [REFERENCE.quantized_linear(x, w) for w in (first, second)]
    first, second = first.to(device()), second.to(device())
    both = fp8_mma_gemv(x.to(device()), [(first.values, first.scales), (second.values, second.scales)],
                        quantize=True)
    assert both.shape == (2, 64 + 160)
    assert_close_to_reference(both[:, :64].cpu(), refs[0])
    assert_close_to_reference(both[:, 64:].cpu(), refs[1])
    alone = fp8_mma_gemv(x.to(device()), [(second.values, second.scales)], quantize=True)
    assert torch.equal(both[:, 64:], alone)  # one split alone and together: the same bits


@pytest.mark.parametrize("m", [1, 4])
def test_grouped_unquantized_matches_reference(monkeypatch, m):
    """``wo_a``: the bf16 activation as it is, each block scaled into f16's range; values far below
    their block's largest (1e-12 of it here) take f16's rounding, which the tolerance covers."""
    _config(monkeypatch, 1, 16)
    gen = torch.Generator().manual_seed(3 + m)
    weight = random_weight(WeightFormat.FP8, 3 * 64, 256, gen)
    x = torch.randn(m, 3, 256, generator=gen) * 1e3
    x[:, :, 5] = 1e-9  # 2**-40 of the block's largest: no longer exact in f16 after the block's scaling
    x[:, 1, 64:96] *= 1e-30  # a whole block of tiny values: its own scale keeps it exact
    x = x.bfloat16()
    ref = REFERENCE.grouped_dequantized_linear(x, weight)
    on = weight.to(device())
    got = fp8_mma_gemv(x.reshape(m, -1).to(device()), [(on.values, on.scales)], quantize=False, groups=3)
    assert_close_to_reference(got.view(m, 3, 64).cpu(), ref)


def test_backend_takes_it_from_two_tokens_up_to_its_token_count(monkeypatch):
    """The backend's products of ``MMA_GEMV_MIN_TOKENS`` (3) to ``MMA_GEMV_MAX_TOKENS`` tokens (one
    weight, a pair, the grouped ``wo_a``) take this kernel, equal to calling it directly; one and two
    tokens keep ``triton_gemv`` (faster there: docs/benchmarks.md), and with the minimum lowered to 2 two
    tokens take it too; above the maximum, in the batch-invariant mode, and with the maximum at 0 (the
    default: the decode form measured faster), the other forms."""
    from model.kernels.triton_backend import TritonKernels

    _config(monkeypatch, 2, 4)
    gen = torch.Generator().manual_seed(5)
    weights = [random_weight(WeightFormat.FP8, n, 256, gen).to(device()) for n in (64, 96)]
    grouped = random_weight(WeightFormat.FP8, 2 * 64, 128, gen).to(device())
    x = torch.randn(4, 256, generator=gen).bfloat16().to(device())
    calls = []
    real = triton_mma_gemv.fp8_mma_gemv
    monkeypatch.setattr(triton_mma_gemv, "fp8_mma_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    # the measured bounds (docs/benchmarks.md): none by default
    assert (tile_configs.MMA_GEMV_MIN_TOKENS, tile_configs.MMA_GEMV_MAX_TOKENS) == (3, 0)
    kernels = TritonKernels()
    kernels.quantized_linear(x[:3], weights[0])  # three tokens: the decode form
    monkeypatch.setattr(tile_configs, "MMA_GEMV_MAX_TOKENS", 8)  # (what --tensor-core-tokens 8 sets)
    kernels.quantized_linear(x[:2], weights[0])  # two tokens: triton_gemv
    assert calls == []
    monkeypatch.setattr(tile_configs, "MMA_GEMV_MIN_TOKENS", 2)  # (what --tensor-core-tokens 2-8 sets)
    monkeypatch.setattr(tile_configs, "MMA_GEMV_MAX_TOKENS", 0)
    kernels.quantized_linear(x[:2], weights[0])
    monkeypatch.setattr(tile_configs, "MMA_GEMV_MAX_TOKENS", 3)
    kernels.quantized_linear(x[:1], weights[0])  # one token: triton_gemv
    assert calls == []
    for rows in (x[:2], x[:3]):
        calls.clear()
        one = kernels.quantized_linear(rows, weights[0])
        pair = kernels.quantized_linears(rows, weights)
        wo_a = kernels.grouped_dequantized_linear(rows[:, :256].reshape(-1, 2, 128), grouped)
        assert calls == [rows.shape[0]] * 3
        assert torch.equal(one, real(rows, [(weights[0].values, weights[0].scales)], quantize=True))
        assert torch.equal(pair[1], real(rows, [(weights[1].values, weights[1].scales)], quantize=True))
        assert wo_a.shape == (rows.shape[0], 2, 64)
    calls.clear()
    kernels.quantized_linear(x, weights[0])  # 4 tokens: the decode form
    TritonKernels(batch_invariant=True).quantized_linear(x[:2], weights[0])
    # a weight whose bytes start off an 8-byte boundary (a view into a larger buffer): the other forms
    buffer = torch.empty(64 * 256 + 4, dtype=torch.uint8, device=device())
    shifted = buffer[4:].view(64, 256)
    shifted.copy_(weights[0].values.view(torch.uint8))
    unaligned = type(weights[0])(shifted.view(weights[0].values.dtype), weights[0].scales, weights[0].fmt)
    assert calls == []
    got = kernels.quantized_linear(x[:2], unaligned)
    assert calls == []
    assert_close_to_reference(got.cpu(), REFERENCE.quantized_linear(x[:2], weights[0]).cpu())


def test_rejects_what_it_does_not_compute():
    gen = torch.Generator().manual_seed(0)
    w = random_weight(WeightFormat.FP8, 64, 128, gen).to(device())
    with pytest.raises(ValueError, match="1 to 8 rows"):
        fp8_mma_gemv(torch.zeros(9, 128, dtype=torch.bfloat16, device=device()), [(w.values, w.scales)],
                     quantize=True)
    with pytest.raises(ValueError, match="K = 96"):
        fp8_mma_gemv(torch.zeros(1, 96, dtype=torch.bfloat16, device=device()), [(w.values, w.scales)],
                     quantize=True)
    shifted = torch.empty(64 * 128 + 4, dtype=torch.uint8, device=device())[4:].view(64, 128)
    with pytest.raises(ValueError, match="8-byte aligned"):
        fp8_mma_gemv(torch.zeros(1, 128, dtype=torch.bfloat16, device=device()), [(shifted, w.scales)], quantize=True)
    assert triton_gemv.fits is triton_mma_gemv.fits  # one rule for both matrix-vector kernels


# ------------------------------------------------------------------ the inline PTX, lane by lane
# The interpreter cannot run inline assembly: the kernel's PTX text is executed for the 32 lanes of a
# warp by ``tests/ptx_warp.py`` (each instruction with its PTX ISA meaning).

def test_group_step_ptx_computes_a_blocks_sums_lane_by_lane():
    """``_GROUP_STEP_PTX`` with each lane's operands laid out as the kernel loads them (rows g and g + 8
    at columns 8t..8t+7, token g's activation at the same columns, the block's scales of tokens 2t and
    2t + 1) returns, in lane (g, t), the running sums plus the block's scaled products of rows g and
    g + 8 with tokens 2t and 2t + 1."""
    gen = torch.Generator().manual_seed(0)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    weight = finite[torch.randint(0, finite.numel(), (16, 32), generator=gen)]  # e4m3 bytes, subnormals too
    act = torch.randn(8, 32, generator=gen).to(torch.float16)
    scale = torch.exp2(torch.randint(-16, 2, (8,), generator=gen).float())  # activation times weight scale
    start = torch.randn(32, 4, generator=gen)

    def word64(row: torch.Tensor) -> int:
        return int(row.contiguous().view(torch.int64).item()) & (2 ** 64 - 1)

    lanes = [(lane >> 2, lane % 4) for lane in range(32)]
    act_bits = act.view(torch.int16)
    operands = [
        [word64(weight[g, 8 * t:8 * t + 8]) for g, t in lanes],
        [word64(weight[g + 8, 8 * t:8 * t + 8]) for g, t in lanes],
        [word64(act_bits[g, 8 * t:8 * t + 4]) for g, t in lanes],
        [word64(act_bits[g, 8 * t + 4:8 * t + 8]) for g, t in lanes],
        [bits32(scale[2 * t].item()) for g, t in lanes],
        [bits32(scale[2 * t + 1].item()) for g, t in lanes],
        *[[bits32(start[lane, j].item()) for lane in range(32)] for j in range(4)],
    ]
    got = run_warp_ptx(triton_mma_gemv._GROUP_STEP_PTX.value, operands, 4)
    products = weight.view(torch.float8_e4m3fn).double() @ act.double().T  # [16 rows, 8 tokens]
    scaled = products * scale.double()[None, :]
    for lane, (g, t) in enumerate(lanes):
        expected = [start[lane, 0] + scaled[g, 2 * t], start[lane, 1] + scaled[g, 2 * t + 1],
                    start[lane, 2] + scaled[g + 8, 2 * t], start[lane, 3] + scaled[g + 8, 2 * t + 1]]
        for j in range(4):
            assert f32(got[lane][j]) == pytest.approx(float(expected[j]), rel=1e-6, abs=1e-6), (lane, j)
