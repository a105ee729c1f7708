"""The FP4 experts' fragment layout (``model/kernels/fp4_fragments.py``) and its Triton reader.

The layout is a permutation of the checkpoint's bytes, so everything here is exact: the round trip
gives the same bytes, each 32-bit word holds the values its docstring says (checked by a model of the
kernel's shift-and-mask expansion written with torch bit operations), and the kernel's tile (in the
interpreter on CPU, with its inline PTX on the GPU) is the dequantized weight bit for bit. The
experts' kernels on weights in this layout are compared with the reference in
``test_triton_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from model.config import WeightFormat  # noqa: E402
from model.kernels import ExpertWeights, QuantizedWeight  # noqa: E402
from model.kernels.fp4_fragments import (MAX_EXPONENT, MIN_EXPONENT, fragments_exact, from_fragments,  # noqa: E402
                                         to_fragments)
from model.kernels.triton_weight_tiles import fragment_offsets, fragment_tile  # noqa: E402
from model.quant import pack_e2m1  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def random_fp4(lead: tuple[int, ...], n: int, k: int, seed: int, exponents=(118, 126)) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, n, k), generator=gen, dtype=torch.uint8)
    scales = torch.randint(exponents[0], exponents[1] + 1, (*lead, n, k // 32), generator=gen, dtype=torch.uint8)
    return QuantizedWeight(pack_e2m1(codes).view(torch.int8), scales.view(torch.float8_e8m0fnu), WeightFormat.FP4)


def test_the_fragment_layout_is_a_permutation_of_the_checkpoint_bytes():
    w = random_fp4((3,), 32, 128, seed=1)
    values, scales = to_fragments(w.values, w.scales)
    assert values.shape == w.values.shape and values.dtype == w.values.dtype
    assert scales.shape == w.scales.shape and scales.dtype == w.scales.dtype
    assert not torch.equal(values, w.values)
    back_values, back_scales = from_fragments(values, scales)
    assert torch.equal(back_values, w.values)
    assert torch.equal(back_scales.view(torch.uint8), w.scales.view(torch.uint8))
    assert torch.equal(torch.sort(scales.view(torch.uint8).flatten()).values,
                       torch.sort(w.scales.view(torch.uint8).flatten()).values)


def expand_like_the_kernel(word: torch.Tensor, scale_g: torch.Tensor, scale_g8: torch.Tensor) -> list[torch.Tensor]:
    """The four bf16x2 registers of ``_FRAGMENT_PTX`` from int64 words, as fp32 pairs ``[.., 2]``."""
    m = 0x81C081C0
    pairs = [word & m, (word << 3) & m, (word << 6) & m,
             ((word << 1) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040)]
    out = []
    for p, bits in enumerate(pairs):
        halves = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dim=-1)
        as_bf16 = (halves << 16).to(torch.int32).view(torch.float32)  # e2m1 x 2**-126, exact in fp32
        exponent = (scale_g if p in (0, 2) else scale_g8).to(torch.int64)
        out.append(as_bf16 * torch.exp2(exponent.float() - 1)[..., None])
    return out


def test_each_register_holds_its_documented_fragment():
    n, k = 32, 128
    w = random_fp4((), n, k, seed=2, exponents=(MIN_EXPONENT, MAX_EXPONENT))
    dense = w.dequantized(torch.float32)
    values, scales = to_fragments(w.values, w.scales)
    words = values.view(torch.uint8).reshape(n // 16, k // 64, 8, 4, 4, 4).view(torch.int32)[..., 0].to(torch.int64)
    words &= 0xFFFFFFFF
    s = scales.view(torch.uint8).reshape(n // 16, k // 32, 8, 2)  # [rg, block, g, h]
    for rg in range(n // 16):
        for kq in range(k // 64):
            for c in range(4):
                block = 2 * kq + c // 2
                for g in range(8):
                    regs = expand_like_the_kernel(words[rg, kq, g, :, c], s[rg, block, g, 0], s[rg, block, g, 1])
                    for t in range(4):
                        col = 64 * kq + 16 * c + 2 * t
                        row = 16 * rg + g
                        expected = [dense[row, col:col + 2], dense[row + 8, col:col + 2],
                                    dense[row, col + 8:col + 10], dense[row + 8, col + 8:col + 10]]
                        for p in range(4):
                            assert torch.equal(regs[p][t], expected[p]), (rg, kq, c, g, t, p)


def test_fragment_ptx_expands_each_lanes_word_lane_by_lane():
    """``_FRAGMENT_PTX`` itself (executed by ``tests/ptx_warp.py``, each instruction with its PTX ISA
    meaning) gives each lane the registers ``expand_like_the_kernel`` documents: the dequantized values
    of its fragment, exactly."""
    from model.kernels.triton_weight_tiles import _FRAGMENT_PTX
    from tests.ptx_warp import bf16, run_warp_ptx

    w = random_fp4((), 16, 64, seed=3, exponents=(MIN_EXPONENT, MAX_EXPONENT))
    dense = w.dequantized(torch.float32)
    values, scales = to_fragments(w.values, w.scales)
    words = values.view(torch.uint8).reshape(8, 4, 4, 4).view(torch.int32)[..., 0]  # [g, t, c]
    s = scales.view(torch.uint8).reshape(2, 8, 2)  # [block, g, h]
    for c in range(4):
        operands = [[int(words[lane >> 2, lane % 4, c]) & 0xFFFFFFFF for lane in range(32)],
                    [int(s[c // 2, lane >> 2, 0]) | int(s[c // 2, lane >> 2, 1]) << 8 for lane in range(32)]]
        got = run_warp_ptx(_FRAGMENT_PTX.value, operands, 4)
        for lane in range(32):
            g, t = lane >> 2, lane % 4
            col = 16 * c + 2 * t
            expected = [dense[g, col:col + 2], dense[g + 8, col:col + 2], dense[g, col + 8:col + 10],
                        dense[g + 8, col + 8:col + 10]]
            for p in range(4):
                pair = [bf16(got[lane][p] & 0xFFFF), bf16(got[lane][p] >> 16)]
                assert pair == expected[p].tolist(), (c, lane, p)


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    pid_w, pid_k = tl.program_id(0), tl.program_id(1)
    words, scales = fragment_offsets(K, BLOCK_W, BLOCK_K)
    first = pid_w * (BLOCK_W // 16)
    k0 = pid_k * BLOCK_K
    tile = fragment_tile(w_ptr + first * (K * 8) + k0 * 8, s_ptr + first * (K // 2) + k0 // 2, words, scales,
                         N // 16 - first, BLOCK_W, BLOCK_K, INTERPRETED)
    rows = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], tile, mask=rows[:, None] < N)


@pytest.mark.parametrize("n,block_w", [(64, 64), (48, 64), (256, 128)])
def test_the_kernel_tile_is_the_dequantized_weight_bit_for_bit(n, block_w):
    from model.kernels.triton_common import INTERPRETED

    k = 256
    w = random_fp4((), n, k, seed=n, exponents=(MIN_EXPONENT, MAX_EXPONENT))
    values, scales = (t.view(torch.uint8).to(device()) for t in to_fragments(w.values, w.scales))
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device=device())
    _tile_kernel[(triton.cdiv(n, block_w), k // 128)](values, scales, out, n, k, BLOCK_W=block_w, BLOCK_K=128,
                                                       INTERPRETED=INTERPRETED)
    assert torch.equal(out.cpu().view(torch.int16), w.dequantized(torch.bfloat16).view(torch.int16))


def test_scales_outside_the_exact_range_keep_the_checkpoint_layout():
    from model.kernels.triton_backend import TritonKernels

    inside = random_fp4((2,), 32, 128, seed=3, exponents=(MIN_EXPONENT, MAX_EXPONENT))
    assert fragments_exact(inside.scales)
    for exponent in (MIN_EXPONENT - 1, MAX_EXPONENT + 1):
        outside = random_fp4((2,), 32, 128, seed=4)
        outside.scales.view(torch.uint8)[1, 5, 2] = exponent
        assert not fragments_exact(outside.scales)
        experts = ExpertWeights(outside, random_fp4((2,), 32, 128, seed=5), random_fp4((2,), 128, 32 * 4, seed=6),
                                first_expert=0, swiglu_limit=0.0)
        TritonKernels().prepare_experts(experts)
        assert not experts.w1.fragments and not experts.w3.fragments


def test_prepared_experts_keep_their_values_for_the_reference():
    from model.kernels.triton_backend import TritonKernels

    weights = [random_fp4((3,), 32, 128, seed=7 + i) for i in range(3)]
    dense = [w.dequantized() for w in weights]
    experts = TritonKernels().prepare_experts(ExpertWeights(*weights, first_expert=0, swiglu_limit=0.0))
    assert all(w.fragments for w in (experts.w1, experts.w3, experts.w2))
    for w, expected in zip((experts.w1, experts.w3, experts.w2), dense):
        assert torch.equal(w.dequantized().view(torch.int16), expected.view(torch.int16))
        assert torch.equal(w[1].dequantized().view(torch.int16), expected[1].view(torch.int16))


def test_expert_moves_carry_the_fragment_layout():
    """Rebalancing copies whole expert slots as bytes: the permutation is per expert, so a moved slot
    holds the moved expert's values in the layout the kernels read."""
    from model.kernels.triton_backend import TritonKernels
    from workers.expert_weight_moves import apply_moves, plan_moves

    weights = [random_fp4((4,), 32, 128, seed=20 + i) for i in range(3)]
    dense = [w.dequantized() for w in weights]
    experts = TritonKernels().prepare_experts(ExpertWeights(*weights, first_expert=0, swiglu_limit=0.0))
    new = (3, 0, 0, 2)
    assert apply_moves(experts, plan_moves((0, 1, 2, 3), new, 1), rank=0, world_size=1) == 4
    for w, expected in zip((experts.w1, experts.w3, experts.w2), dense):
        assert w.fragments
        for slot, expert in enumerate(new):
            assert torch.equal(w[slot].dequantized().view(torch.int16), expected[expert].view(torch.int16))
