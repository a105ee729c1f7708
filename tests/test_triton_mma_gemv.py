"""A few tokens' FP8 products on the tensor cores (``model/kernels/triton_mma_gemv.py``) against the
reference arithmetic, in Triton's interpreter at tiny shapes (on CUDA: the same shapes on the GPU,
where the tensor-core instruction itself runs; in the interpreter a twin made of tensor operations
computes it over the same per-lane fragments, so the lanes' addressing is what is tested there).

Tolerance: ``assert_close_to_reference`` (one bf16 ulp of the value plus 2**-16 of the row's largest
output), as for ``triton_gemv``: the products are exact and only the order of the fp32 sums inside a
32-column block differs from the reference's (``test_triton_kernels.py``'s docstring derives the bound).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from model.config import WeightFormat  # noqa: E402
from model.kernels import tile_configs, triton_gemv, triton_mma_gemv, triton_split_sums  # noqa: E402
from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.kernels.triton_mma_gemv import fp8_mma_gemv  # noqa: E402
from tests.kernel_checks import device  # noqa: E402
from tests.test_triton_kernels import assert_close_to_reference, random_weight  # noqa: E402

REFERENCE = ReferenceKernels(batch_invariant=False)


def _config(monkeypatch, warps: int, programs_per_sm: int, max_splits: int = 64, sms: int = 132,
            step_blocks: int = 1) -> None:
    cfg = tile_configs.DecodeConfig(32 * warps, 32 * step_blocks, warps, 1, programs_per_sm, max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_TABLE", ((8, cfg),))
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


def test_backend_takes_it_up_to_its_token_count(monkeypatch):
    """With ``MMA_GEMV_MAX_TOKENS`` set, the backend's products of 1..N tokens (one weight, a pair, the
    grouped ``wo_a``) take this kernel, equal to calling it directly; at N + 1 tokens, and in the
    batch-invariant mode, the other forms. Left at 0 (its value until the kernel is measured on a GPU),
    nothing takes it."""
    from model.kernels.triton_backend import TritonKernels

    _config(monkeypatch, 2, 4)
    gen = torch.Generator().manual_seed(5)
    weights = [random_weight(WeightFormat.FP8, n, 256, gen).to(device()) for n in (64, 96)]
    grouped = random_weight(WeightFormat.FP8, 2 * 64, 128, gen).to(device())
    x = torch.randn(4, 256, generator=gen).bfloat16().to(device())
    calls = []
    real = triton_mma_gemv.fp8_mma_gemv
    monkeypatch.setattr(triton_mma_gemv, "fp8_mma_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    assert tile_configs.MMA_GEMV_MAX_TOKENS == 0
    kernels = TritonKernels()
    kernels.quantized_linear(x[:1], weights[0])
    assert calls == []
    monkeypatch.setattr(tile_configs, "MMA_GEMV_MAX_TOKENS", 3)
    for rows in (x[:1], x[:3]):
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
    TritonKernels(batch_invariant=True).quantized_linear(x[:1], weights[0])
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
# The interpreter cannot run inline assembly, so the kernel's PTX is checked here by executing its
# text for the 32 lanes of a warp: each instruction it uses with its PTX ISA meaning, the tensor-core
# instruction with the fragment layout of the ISA's "Matrix Fragments for mma.m16n8k16 with floating
# point type" (groupID = lane >> 2, threadID_in_group = lane % 4), independently of how the kernel
# chose its fragments.

def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _e4m3_to_f16_bits(byte: int) -> int:
    value = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _run_warp_ptx(ptx: str, operands: list[list[int]], outputs: int) -> list[list[int]]:
    """Execute ``ptx`` for 32 lanes; ``operands[i][lane]`` is the bit pattern of ``$(outputs + i)``.
    Returns ``[lane][j]``, the bits of ``$j`` for each output j."""
    regs = [{f"${outputs + i}": op[lane] for i, op in enumerate(operands)} for lane in range(32)]
    for raw in ptx.splitlines():
        line = raw.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        opcode, rest = line.split(None, 1)
        args = [a.strip() for a in re.split(r",\s*(?![^{]*})", rest)]
        vec = [[v.strip() for v in a.strip("{}").split(",")] for a in args]
        if opcode.startswith("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"):
            a_mat, b_mat, c_mat = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for lane, r in enumerate(regs):
                g, t = lane >> 2, lane % 4
                a_vals = [h for reg in vec[1] for h in (r[reg] & 0xFFFF, r[reg] >> 16)]  # a0..a7, low half first
                for i, h in enumerate(a_vals):
                    a_mat[g + 8 * (i % 4 >= 2), 2 * t + (i & 1) + 8 * (i >= 4)] = _f16(h)
                b_vals = [h for reg in vec[2] for h in (r[reg] & 0xFFFF, r[reg] >> 16)]
                for i, h in enumerate(b_vals):
                    b_mat[2 * t + (i & 1) + 8 * (i >= 2), g] = _f16(h)
                for i, reg in enumerate(vec[3]):
                    c_mat[g + 8 * (i >= 2), 2 * t + (i & 1)] = _f32(r[reg])
            d_mat = a_mat @ b_mat + c_mat
            for lane, r in enumerate(regs):
                g, t = lane >> 2, lane % 4
                for i, reg in enumerate(vec[0]):
                    r[reg] = _bits(d_mat[g + 8 * (i >= 2), 2 * t + (i & 1)])
            continue
        for r in regs:
            val = lambda a: int(a[2:], 16) if a.startswith("0f") else (int(a) if a.isdigit() else r[a])  # noqa: E731
            if opcode in ("mov.b64", "mov.b32"):
                width = 32 if opcode == "mov.b64" else 16
                r[vec[0][0]], r[vec[0][1]] = r[args[1]] & ((1 << width) - 1), r[args[1]] >> width
            elif opcode == "cvt.rn.f16x2.e4m3x2":
                h = r[args[1]]
                r[args[0]] = _e4m3_to_f16_bits(h & 0xFF) | _e4m3_to_f16_bits(h >> 8) << 16
            elif opcode == "mov.f32":
                r[args[0]] = val(args[1])
            elif opcode == "shl.b32":
                r[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
            elif opcode == "mul.f32":
                r[args[0]] = _bits(_f32(val(args[1])) * _f32(val(args[2])))
            elif opcode == "fma.rn.f32":
                r[args[0]] = _bits(_f32(val(args[1])) * _f32(val(args[2])) + _f32(val(args[3])))
            else:
                raise AssertionError(f"the test does not know {opcode}")
    return [[r[f"${j}"] for j in range(outputs)] for r in regs]


def test_group_step_ptx_computes_a_blocks_sums_lane_by_lane():
    """``_GROUP_STEP_PTX`` with each lane's operands laid out as the kernel loads them (rows g and
    g + 8 at columns 8t..8t+7, token g's activation at the same columns, the scales of tokens 2t and
    2t + 1) returns, in lane (g, t), the running sums plus the block's scaled products of rows g and
    g + 8 with tokens 2t and 2t + 1."""
    gen = torch.Generator().manual_seed(0)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    weight = finite[torch.randint(0, finite.numel(), (16, 32), generator=gen)]  # e4m3 bytes, subnormals too
    act = torch.randn(8, 32, generator=gen).to(torch.float16)
    act_scale = torch.exp2(torch.randint(-8, 8, (8,), generator=gen).float())
    w_exp = 120  # 2**-7
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
        [word64(act_scale[2 * t:2 * t + 2]) for g, t in lanes],
        [w_exp] * 32,
        *[[_bits(start[lane, j].item()) for lane in range(32)] for j in range(4)],
    ]
    got = _run_warp_ptx(triton_mma_gemv._GROUP_STEP_PTX.value, operands, 4)
    products = weight.view(torch.float8_e4m3fn).double() @ act.double().T  # [16 rows, 8 tokens]
    scaled = products * act_scale.double()[None, :] * 2.0 ** (w_exp - 127)
    for lane, (g, t) in enumerate(lanes):
        expected = [start[lane, 0] + scaled[g, 2 * t], start[lane, 1] + scaled[g, 2 * t + 1],
                    start[lane, 2] + scaled[g + 8, 2 * t], start[lane, 3] + scaled[g + 8, 2 * t + 1]]
        for j in range(4):
            assert _f32(got[lane][j]) == pytest.approx(float(expected[j]), rel=1e-6, abs=1e-6), (lane, j)
