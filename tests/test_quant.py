"""FP8 / FP4 quantize-dequantize (QDQ) and weight operands, against the golden vectors and by hand.

Golden ``comp.*`` vectors come from the reference kernels (README section 6); the hand-made
cases pin the corners: round-to-nearest-even ties of E2M1, saturation, zero groups, signed zeros
and the power-of-two scale at and just above a power of two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.quant import (
    E2M1_VALUES,
    dequantize_fp4_weight,
    dequantize_fp8_rows,
    dequantize_fp8_weight,
    e2m1_codes,
    e2m1_values,
    fp4_qdq,
    fp4_quantize,
    fp4_weight_operands,
    fp8_qdq,
    fp8_quantize,
    fp8_weight_operands,
    pack_e2m1,
    pow2_scale,
    to_e4m3,
    unpack_e2m1,
)

FP8_MAX_INV = torch.tensor(1.0 / 448.0, dtype=torch.float32)
ONE = torch.tensor(1.0)

FP4_VARIANTS = [  # (golden key, group size, e4m3 scales)
    ("fp4_act_quant_ue8m0_g32", 32, False),  # index queries / keys
    ("fp4_act_quant_e4m3_g16", 16, True),  # compressed KV
]


@pytest.fixture(scope="module")
def comp(golden_dir: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(golden_dir / "cases.safetensors"))
    return {k[len("comp."):]: v for k, v in tensors.items() if k.startswith("comp.")}


def bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern, so that -0.0 != +0.0 and NaN payloads count."""
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    same = bits(actual) == bits(expected)
    if not bool(same.all()):
        where = torch.nonzero(~same)[:5].tolist()
        raise AssertionError(f"{int((~same).sum())} elements differ, first at {where}: "
                             f"{actual[tuple(torch.tensor(where[0]))]} vs {expected[tuple(torch.tensor(where[0]))]}")


def group(values: list[float], size: int, fill: float = 0.0) -> torch.Tensor:
    """One bf16 row of ``size`` values starting with ``values`` (checked to be exact in bf16)."""
    row = torch.full((size,), fill, dtype=torch.float32)
    row[: len(values)] = torch.tensor(values, dtype=torch.float32)
    out = row.to(torch.bfloat16)
    assert torch.equal(bits(out.float()), bits(row)), "test value not representable in bf16"
    return out.unsqueeze(0)


# ----------------------------------------------------------------------------- golden vectors
def test_act_quant_matches_golden_bitwise(comp) -> None:
    x = comp["act_quant.x"]
    q, s = fp8_quantize(x, 32)
    assert_bitwise(q, comp["act_quant.q"])
    assert_bitwise(s, comp["act_quant.s"].float())
    assert_bitwise(fp8_qdq(x, 32), comp["act_quant.qdq"])


@pytest.mark.parametrize("key,block,e4m3", FP4_VARIANTS)
def test_fp4_act_quant_matches_golden_bitwise(comp, key: str, block: int, e4m3: bool) -> None:
    x = comp[f"{key}.x"]
    packed, s = fp4_quantize(x, block, e4m3)
    assert_bitwise(packed, comp[f"{key}.packed"])
    assert_bitwise(s, comp[f"{key}.s"].float())
    assert_bitwise(fp4_qdq(x, block, e4m3), comp[f"{key}.qdq"])


@pytest.mark.parametrize("key,block,e4m3", FP4_VARIANTS)
def test_fp4_qdq_is_dequantized_packed_codes(comp, key: str, block: int, e4m3: bool) -> None:
    """qdq == unpack(packed) * scale: the two entry points agree (on the golden inputs)."""
    x = comp[f"{key}.x"]
    packed, s = fp4_quantize(x, block, e4m3)
    values = e2m1_values(unpack_e2m1(packed)).unflatten(-1, (-1, block)) * s.unsqueeze(-1)
    assert_bitwise(values.flatten(-2).to(torch.bfloat16), fp4_qdq(x, block, e4m3))


def test_qdq_results_are_idempotent(comp) -> None:
    """A QDQ result is on the format's grid: quantizing it again changes nothing."""
    y = fp8_qdq(comp["act_quant.x"], 32)
    assert_bitwise(fp8_qdq(y, 32), y)
    for key, block, e4m3 in FP4_VARIANTS:
        y = fp4_qdq(comp[f"{key}.x"], block, e4m3)
        if not e4m3:  # with E4M3 scales amax/6 is re-rounded, so only the power-of-two variant is a fixed point
            assert_bitwise(fp4_qdq(y, block, e4m3), y)


def test_fp8_qdq_is_idempotent_where_the_scale_halves() -> None:
    """FP8-ready rows (``model/kernels/backend.py``) rest on this: a round trip's result rounds to itself,
    also where its group maximum rounded down to 224 times the scale (then the second round trip takes
    half the scale and twice the values: the same products) and near the 1e-4 floor of the maximum."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 32 * 48, generator=gen) * torch.logspace(-12, 4, 32 * 48)  # every scale, floors too
    rows[0, :32] = 0.0
    rows[1, :3] = torch.tensor([14.0625, -3.0, 1.0])  # max -> 224 * 2**-4 = 14.0, requantized at 2**-5
    rows[2, :2] = torch.tensor([1.0001e-4, 3e-5])  # just above the floor
    x = rows.bfloat16()
    y = fp8_qdq(x, 32)
    assert y[1, 0].item() == 14.0 and fp8_quantize(y[1:2, :32])[1].item() == 2.0 ** -5
    assert_bitwise(fp8_qdq(y, 32), y)


# ----------------------------------------------------------------------------- the scale
def test_pow2_scale_at_and_just_above_a_power_of_two() -> None:
    exact = torch.tensor([1.0, 2.0 ** -10, 0.5, 2.0 ** 20, 2.0 ** -126])
    assert_bitwise(pow2_scale(exact, ONE), exact)
    above = torch.nextafter(exact, torch.tensor(float("inf")))
    assert_bitwise(pow2_scale(above, ONE), exact * 2)
    assert_bitwise(pow2_scale(torch.tensor([0.75, 0.5000001, 3.0]), ONE), torch.tensor([1.0, 1.0, 4.0]))


def test_fp8_scale_at_and_just_above_power_of_two() -> None:
    # amax 448 * 2^-5 = 14 -> scale exactly 2^-5 and the max maps to 448; one bf16 ulp above -> 2^-4
    at = group([14.0, -3.0, 1.0], 32)
    q, s = fp8_quantize(at)
    assert s.tolist() == [[2.0 ** -5]]
    assert q.float()[0, :3].tolist() == [448.0, -96.0, 32.0]
    above = group([14.0625, -3.0, 1.0], 32)  # one bf16 ulp (2^-4) above 14
    q, s = fp8_quantize(above)
    assert s.tolist() == [[2.0 ** -4]]
    assert q.float()[0, 0].item() == 224.0  # 225 rounds to the e4m3 grid (spacing 16 above 128)
    assert fp8_qdq(above)[0, 0].item() == 14.0


@pytest.mark.parametrize("amax,scale", [(1.5, 2.0 ** -2), (1.5078125, 2.0 ** -1), (6.0, 1.0), (24.0, 4.0),
                                        (24.125, 8.0)])
def test_fp4_power_of_two_scale_boundary(amax: float, scale: float) -> None:
    """UE8M0 variant: scale = 2^ceil(log2(amax/6)); exactly 6*2^k gives 2^k, just above gives 2^(k+1)."""
    _, s = fp4_quantize(group([amax], 32), 32, False)
    assert s.tolist() == [[scale]]


@pytest.mark.parametrize("amax,scale", [(6.0, 1.0), (6.375, 1.0), (6.75, 1.125), (7.0, 1.125), (3.0, 0.5)])
def test_fp4_e4m3_scale_rounds_amax_over_6_to_nearest_even(amax: float, scale: float) -> None:
    """E4M3 variant: scale = e4m3(amax/6), not a power of two; 1.0625 is a tie -> even (1.0)."""
    _, s = fp4_quantize(group([amax], 16), 16, True)
    assert s.tolist() == [[scale]]


# ----------------------------------------------------------------------------- E2M1 rounding
# exact midpoints of the E2M1 grid and where round-to-nearest-even sends them
E2M1_TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("block,e4m3", [(32, False), (16, True)])
def test_e2m1_ties_round_to_even(block: int, e4m3: bool) -> None:
    # amax 6 gives scale exactly 1 in both variants, so the group's values are the E2M1 inputs
    expected = {m: r for m, r in E2M1_TIES} | {-m: -r for m, r in E2M1_TIES} | {6.0: 6.0}
    values = list(expected)  # 15 values: fits a group of 16 and of 32
    x = group(values, block)
    _, s = fp4_quantize(x, block, e4m3)
    assert s.tolist() == [[1.0]]
    y = fp4_qdq(x, block, e4m3).float()[0]
    for i, v in enumerate(values):
        assert y[i].item() == expected[v], f"{v} -> {y[i].item()}, expected {expected[v]}"
        assert bool(torch.signbit(y[i])) == (v < 0), f"sign of {v} lost"


def test_e2m1_codes_for_every_tie_and_its_neighbours() -> None:
    mids = torch.tensor([m for m, _ in E2M1_TIES])
    expected_codes = torch.tensor([0, 2, 2, 4, 4, 6, 6], dtype=torch.uint8)  # even codes only
    assert torch.equal(e2m1_codes(mids), expected_codes)
    assert torch.equal(e2m1_codes(-mids), expected_codes | 8)
    up = torch.nextafter(mids, torch.tensor(10.0))
    down = torch.nextafter(mids, torch.tensor(0.0))
    assert torch.equal(e2m1_codes(up), torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8))
    assert torch.equal(e2m1_codes(down), torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.uint8))
    # every grid value maps to its own code and back
    grid = torch.cat([E2M1_VALUES, -E2M1_VALUES])
    assert_bitwise(e2m1_values(e2m1_codes(grid)), grid)


def test_e2m1_just_above_and_below_a_tie_in_qdq() -> None:
    # one bf16 ulp either side of the ties 0.25 and 5, amax 6 (scale 1): no longer ties
    x = group([6.0, 0.25 + 2.0 ** -9, 0.25 - 2.0 ** -10, 5.0 + 2.0 ** -5, 5.0 - 2.0 ** -5, 5.0], 32)
    for e4m3, block in ((False, 32), (True, 16)):
        y = fp4_qdq(x[:, :block], block, e4m3).float()[0, :6].tolist()
        assert y == [6.0, 0.5, 0.0, 6.0, 4.0, 4.0]


# ----------------------------------------------------------------------------- saturation
def test_to_e4m3_saturates_at_448_instead_of_nan() -> None:
    x = torch.tensor([448.0, 463.0, 464.0, 500.0, 1e9, float("inf"), -1e9, float("-inf"), 240.0])
    y = to_e4m3(x).float()
    assert y.tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0, 240.0]


def test_fp8_group_maximum_lands_on_448() -> None:
    # with a power-of-two scale >= amax/448 nothing exceeds 448; the max itself hits it exactly
    x = group([448.0, -448.0, 446.0, 434.0], 32)
    q, s = fp8_quantize(x)
    assert s.tolist() == [[1.0]]
    assert q.float()[0, :4].tolist() == [448.0, -448.0, 448.0, 448.0]  # e4m3 spacing is 32 above 256
    assert q.float()[0, 4:].abs().sum().item() == 0


def test_fp4_e4m3_scale_rounding_down_saturates_at_6() -> None:
    # amax 6.25: 6.25/6 rounds to the e4m3 scale 1.0, so 6.25 / 1.0 > 6 saturates to the top code
    x = group([6.25, -6.25, 1.0], 16)
    packed, s = fp4_quantize(x, 16, True)
    assert s.tolist() == [[1.0]]
    codes = unpack_e2m1(packed)[0, :3].tolist()
    assert codes == [7, 15, 2]
    assert fp4_qdq(x, 16, True).float()[0, :3].tolist() == [6.0, -6.0, 1.0]


# ----------------------------------------------------------------------------- zeros and signs
def test_zero_groups_have_the_floor_scale_and_stay_zero() -> None:
    zero = torch.zeros(1, 32, dtype=torch.bfloat16)
    q, s = fp8_quantize(zero)
    assert s.tolist() == [[2.0 ** -22]]  # amax floored at 1e-4: 2^ceil(log2(1e-4/448))
    assert_bitwise(q.float(), torch.zeros(1, 32))
    assert_bitwise(fp8_qdq(zero), zero)
    packed, s = fp4_quantize(zero, 32, False)
    assert s.tolist() == [[2.0 ** -126]]  # floor 6 * 2^-126
    assert packed.tolist() == [[0] * 16]
    packed, s = fp4_quantize(zero[:, :16], 16, True)
    assert s.tolist() == [[2.0 ** -9]]  # floor 6 * 2^-9: the smallest e4m3 subnormal
    assert packed.tolist() == [[0] * 8]
    # a zero group next to a large one is not affected by it (scales are per group)
    x = torch.cat([zero, group([100.0], 32)], dim=1)
    assert_bitwise(fp8_qdq(x)[:, :32], zero)


def test_negative_zero_is_preserved() -> None:
    x = group([5.0, -0.0, 0.0, -2.0 ** -7], 32)
    for y in (fp8_qdq(x), fp4_qdq(x, 32), fp4_qdq(x[:, :16], 16, True)):
        y = y.float()[0]
        assert y[1].item() == 0.0 and bool(torch.signbit(y[1])), "-0.0 lost its sign"
        assert y[2].item() == 0.0 and not bool(torch.signbit(y[2]))
    # a negative value that underflows to zero in FP4 keeps its sign (as in the golden vectors)
    for e4m3, block in ((False, 32), (True, 16)):
        assert fp4_qdq(x[:, :block], block, e4m3)[0, 3].item() == 0.0
        assert bool(torch.signbit(fp4_qdq(x[:, :block], block, e4m3)[0, 3]))
    packed, s = fp4_quantize(x, 32, False)
    assert s.tolist() == [[1.0]]
    assert unpack_e2m1(packed)[0, :4].tolist() == [6, 8, 0, 8]  # 5 is a tie -> 4 (code 6); -0 -> code 8


# ----------------------------------------------------------------------------- weight operands
def e8m0(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    out = t.to(torch.float8_e8m0fnu)
    assert torch.equal(out.float(), t), "scales must be powers of two"
    return out


def e4m3_grid_weight(rows: int, cols: int) -> torch.Tensor:
    """Deterministic e4m3 weight whose values are all exactly representable (and signed)."""
    grid = torch.tensor([0.0, 0.5, -1.0, 1.5, -2.0, 3.0, -0.25, 448.0, -448.0, 0.015625, 6.0, -7.0])
    idx = (torch.arange(rows).unsqueeze(1) * 7 + torch.arange(cols).unsqueeze(0) * 3) % len(grid)
    w = grid[idx].to(torch.float8_e4m3fn)
    assert torch.equal(w.float(), grid[idx])
    return w


def test_fp8_weight_operands_expand_tile_scales_per_row() -> None:
    w = e4m3_grid_weight(40, 64)  # 40 rows: the second row tile is partial
    scale = e8m0([[2.0 ** -3, 2.0], [2.0 ** -7, 1.0]])
    values, row_scales = fp8_weight_operands(w, scale)
    assert values.dtype == torch.float32 and row_scales.dtype == torch.float32
    assert torch.equal(values, w.float())
    assert row_scales.shape == (40, 2)
    for n in range(40):
        assert row_scales[n].tolist() == scale.float()[n // 32].tolist(), n
    deq = dequantize_fp8_weight(w, scale)
    assert deq.dtype == torch.bfloat16 and deq.shape == (40, 64)
    for n, k in [(0, 0), (5, 31), (5, 32), (31, 63), (32, 0), (39, 40), (39, 63)]:
        assert deq[n, k].item() == w[n, k].float().item() * scale.float()[n // 32, k // 32].item(), (n, k)
    # the block-scaled operands reproduce the dequantized weight exactly
    assert torch.equal((values * row_scales.repeat_interleave(32, 1)).to(torch.bfloat16), deq)


def test_fp4_weight_operands_unpack_low_nibble_first() -> None:
    raw = torch.zeros(2, 16, dtype=torch.uint8)
    raw[0, 0], raw[0, 1], raw[0, 2] = 0x21, 0x8F, 0x70  # (0.5, 1.0), (-6.0, -0.0), (0.0, 6.0)
    raw[1, 0], raw[1, 15] = 0x9A, 0x3B  # (-1.0, -0.5); (-1.5, 1.5) in the last byte
    packed = raw.view(torch.int8)  # the checkpoint stores I8
    scale = e8m0([[2.0 ** -2], [8.0]])
    values, scales = fp4_weight_operands(packed, scale)
    assert values.shape == (2, 32) and values.dtype == torch.float32
    assert values[0, :6].tolist() == [0.5, 1.0, -6.0, 0.0, 0.0, 6.0]
    assert bool(torch.signbit(values[0, 3])) and not bool(torch.signbit(values[0, 4]))
    assert values[1, :2].tolist() == [-1.0, -0.5] and values[1, 30:].tolist() == [-1.5, 1.5]
    assert values[0, 6:].abs().sum().item() == 0 and values[1, 2:30].abs().sum().item() == 0
    assert scales.tolist() == [[0.25], [8.0]]
    deq = dequantize_fp4_weight(packed, scale)
    assert deq.dtype == torch.bfloat16
    assert deq[0, :6].float().tolist() == [0.125, 0.25, -1.5, 0.0, 0.0, 1.5]
    assert deq[1, :2].float().tolist() == [-8.0, -4.0] and deq[1, 30:].float().tolist() == [-12.0, 12.0]
    # packing the codes again gives the same bytes
    assert torch.equal(pack_e2m1(unpack_e2m1(packed)), raw)


def test_fp4_weight_scales_are_per_row_per_32() -> None:
    codes = torch.full((1, 64), 2, dtype=torch.uint8)  # all 1.0
    packed = pack_e2m1(codes).view(torch.int8)
    deq = dequantize_fp4_weight(packed, e8m0([[0.5, 4.0]]))
    assert deq[0, :32].float().unique().tolist() == [0.5]
    assert deq[0, 32:].float().unique().tolist() == [4.0]


def test_dequantize_fp8_rows_scales_each_row_per_32_columns() -> None:
    w = e4m3_grid_weight(3, 64)
    scale = e8m0([[1.0, 2.0], [2.0 ** -4, 2.0 ** 3], [0.5, 0.25]])
    deq = dequantize_fp8_rows(w, scale)
    assert deq.dtype == torch.bfloat16
    expected = torch.stack([w.float()[r] * scale.float()[r].repeat_interleave(32) for r in range(3)])
    assert torch.equal(deq.float(), expected)  # exact: e4m3 times a power of two fits bf16
