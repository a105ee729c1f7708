"""The KV cache's byte formats (model/cache_formats.py): what is written is read back bit for bit.

Values written are round-trip outputs (fp8_qdq / fp4_qdq); the checks sweep every positive finite
bf16 value as a group maximum (so every scale the formats can take), random and adversarial groups
(zeros, signed zeros, subnormals, huge magnitudes, ties), the reference's own bytes from the golden
set, the row layout by hand, and the bytes-per-token figure of V4.1-Flash.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from model.cache import V41Cache, bytes_per_block, bytes_per_slot, kv_bytes_per_token
from model.cache_formats import COMPRESSED_KV, INDEX_KEYS, WINDOW_KV, QuantizedRows, RowCodec, RowFormat
from model.config import V41Config
from model.presets import preset_config
from model.quant import E2M1_SIGNED, fp4_qdq, fp4_quantize, fp8_qdq, fp8_quantize, unpack_e2m1
from model.tokenizer_builder import train_tokenizer

ROUND_TRIPS = {  # format -> (its round trip, its quantizer: values -> (codes, fp32 scales))
    WINDOW_KV: (lambda x: fp8_qdq(x, 32), lambda x: fp8_quantize(x, 32)),
    COMPRESSED_KV: (lambda x: fp4_qdq(x, 16, e4m3_scale=True), lambda x: fp4_quantize(x, 16, True)),
    INDEX_KEYS: (lambda x: fp4_qdq(x, 32), lambda x: fp4_quantize(x, 32, False)),
}
FORMATS = list(ROUND_TRIPS)
FORMAT_IDS = ["window_kv", "compressed_kv", "index_keys"]
WIDTH = 64  # two groups of 32, four of 16


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def store_and_read(fmt: RowFormat, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write bf16 rows [N, W] into a fresh store at shuffled rows, read them back: (values, row bytes)."""
    n = values.shape[0]
    store = QuantizedRows(RowCodec(fmt, values.shape[-1], "cpu"), (n + 1,), "cpu")
    where = torch.randperm(n, generator=torch.Generator().manual_seed(n)) + 1
    store.write(where, values=values)
    return store.read(where), store.data[where]


def every_group_maximum(fmt: RowFormat) -> torch.Tensor:
    """bf16 rows [N, WIDTH]: for every positive finite bf16 value a, a row whose first group has
    maximum a and whose second has maximum -a, the rest random in [-a, a] (every 7th row: zeros)."""
    a = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()
    g = fmt.group
    rows = a[:, None] * (torch.rand(a.shape[0], WIDTH, generator=torch.Generator().manual_seed(1)) * 2 - 1)
    rows[::7, 1:g] = 0
    rows[3::7, g + 1:] = -0.0
    rows[:, 0], rows[:, g] = a, -a
    return rows.to(torch.bfloat16)


# ----------------------------------------------------------------------------- values read back
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_every_group_maximum_reads_back_bit_for_bit(fmt: RowFormat) -> None:
    round_trip, _ = ROUND_TRIPS[fmt]
    y = round_trip(every_group_maximum(fmt))
    finite = torch.isfinite(y.float()).all(-1)
    # only groups the round trip itself took to infinity (a maximum near bf16's) are lost
    overflowed = every_group_maximum(fmt)[~finite, 0].float()
    assert bool((overflowed > 2.9e38).all()), overflowed.min()
    back, _ = store_and_read(fmt, y[finite])
    mismatch = (bits(back) != bits(y[finite])).any(-1)
    assert not bool(mismatch.any()), y[finite][mismatch][:3]


SPECIAL = [0.0, -0.0, 1.0, -1.0, 6.0, 448.0, 2.0**-6, -(2.0**-6), 2.0**-8 * 4.5, 2.0**-9, 2.0**-126, 2.0**-133,
           -(2.0**-133), 1e-4, 3.0e38, -3.0e38, 0.75, 1.75, 3.5, 5.0]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_groups_read_back_bit_for_bit(data) -> None:
    """Random rows mixing arbitrary floats with the corner values, scaled by a random power of two."""
    element = st.one_of(st.floats(-3e38, 3e38), st.sampled_from(SPECIAL))
    values = data.draw(st.lists(element, min_size=WIDTH, max_size=WIDTH), "values")
    exponent = data.draw(st.integers(-140, 100), "exponent")
    x = (torch.tensor(values, dtype=torch.float64) * 2.0**exponent).clamp(-3e38, 3e38)
    x = x.to(torch.float32).to(torch.bfloat16).unsqueeze(0)
    for fmt, (round_trip, _) in ROUND_TRIPS.items():
        y = round_trip(x)
        if not bool(torch.isfinite(y.float()).all()):
            continue  # the round trip overflowed: nothing to store
        back, _ = store_and_read(fmt, y)
        assert torch.equal(bits(back), bits(y)), (fmt, x, y, back)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_signed_zeros_and_unwritten_rows(fmt: RowFormat) -> None:
    round_trip, _ = ROUND_TRIPS[fmt]
    zeros = torch.tensor([[0.0, -0.0] * (WIDTH // 2), [-0.0] * WIDTH, [-(2.0**-133)] * WIDTH], dtype=torch.bfloat16)
    y = round_trip(zeros)
    assert bool(torch.signbit(y[2]).all())  # a tiny negative rounds to -0.0, which the cache must keep
    back, row_bytes = store_and_read(fmt, y)
    assert torch.equal(bits(back), bits(y))
    assert bool((row_bytes[:, fmt.code_bytes(WIDTH):] != 0).all())  # a written row has nonzero scale bytes
    store = QuantizedRows(RowCodec(fmt, WIDTH, "cpu"), (3,), "cpu")
    assert torch.equal(bits(store.read(torch.arange(3))), bits(torch.zeros(3, WIDTH, dtype=torch.bfloat16)))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_values_not_yet_rounded_are_stored_as_their_round_trip(fmt: RowFormat) -> None:
    """A writer that skipped the round trip still reads back round-trip values (compressed KV: except a
    group maximum of exactly 2**-6, which keeps the scale a round-trip output of that maximum has)."""
    round_trip, _ = ROUND_TRIPS[fmt]
    x = torch.randn(512, WIDTH, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[:64] *= 2.0**-7  # groups around the subnormal compressed-KV scales
    back, _ = store_and_read(fmt, x)
    same = (bits(back) == bits(round_trip(x))).unflatten(-1, (-1, fmt.group)).all(-1)
    exception = x.float().abs().unflatten(-1, (-1, fmt.group)).amax(-1) == 2.0**-6
    assert bool((same | exception).all()) and (fmt is COMPRESSED_KV or not bool(exception.any()))


# ----------------------------------------------------------------------------- the bytes themselves
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_bytes_are_the_quantizers_up_to_the_documented_halving(fmt: RowFormat) -> None:
    """Stored (codes, scales) vs the quantizer's on the values before their round trip: compressed
    KV is always identical; a UE8M0 group may instead hold half the scale and doubled codes, and only
    when the quantizer's largest code was the smallest one its scale allows (FP8 224, FP4 3)."""
    round_trip, quantize = ROUND_TRIPS[fmt]
    x = every_group_maximum(fmt)
    y = round_trip(x)
    finite = torch.isfinite(y.float()).all(-1)
    x, y = x[finite], y[finite]
    _, row_bytes = store_and_read(fmt, y)
    ref_codes, ref_scale = quantize(x)
    ours = code_values(fmt, row_bytes[:, : fmt.code_bytes(WIDTH)]).unflatten(-1, (-1, fmt.group))
    theirs = code_values(fmt, ref_codes.view(torch.uint8)).unflatten(-1, (-1, fmt.group))
    our_scale = scale_values(fmt, row_bytes[:, fmt.code_bytes(WIDTH):])
    same = (our_scale == ref_scale) & (bits(ours.to(torch.bfloat16)) == bits(theirs.to(torch.bfloat16))).all(-1)
    if fmt is COMPRESSED_KV:
        assert bool(same.all())
        return
    smallest_max = 224.0 if fmt is WINDOW_KV else 3.0
    halved = ((our_scale == ref_scale / 2) & (ours == 2 * theirs).all(-1)
              & (theirs.abs().amax(-1) == smallest_max))
    assert bool((same | halved).all())
    assert 0 < int(halved.sum()) < halved.numel() // 4  # the exception exists and stays one


def test_compressed_kv_scale_at_the_one_ambiguous_maximum() -> None:
    """Before the round trip in [9, 10) * 2**-9: scale 2**-8, largest code 4, read back 2**-6; the
    quantizer given 2**-6 would pick 2**-9 and clip to 6 * 2**-9, so the cache keeps 2**-8."""
    x = torch.full((1, 16), 0.0, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 9.5 * 2.0**-9, -3 * 2.0**-9
    y = fp4_qdq(x, 16, e4m3_scale=True)
    assert y[0, 0].item() == 2.0**-6 and y[0, 1].item() == -(1.5 * 2.0**-8)
    assert fp4_qdq(y, 16, e4m3_scale=True)[0, 0].item() == 6 * 2.0**-9  # the round trip is no fixed point here
    back, row_bytes = store_and_read(COMPRESSED_KV, y)
    assert torch.equal(bits(back), bits(y))
    assert row_bytes[0, 8].item() == torch.tensor(2.0**-8).to(torch.float8_e4m3fn).view(torch.uint8).item()


def code_values(fmt: RowFormat, codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each code (FP4: unpacked) of code bytes [..., code_bytes]."""
    if fmt is WINDOW_KV:
        return codes.view(torch.float8_e4m3fn).float()
    return E2M1_SIGNED[unpack_e2m1(codes).long()]


def scale_values(fmt: RowFormat, scale_bytes: torch.Tensor) -> torch.Tensor:
    if fmt is COMPRESSED_KV:
        return scale_bytes.view(torch.float8_e4m3fn).float()
    return torch.exp2(scale_bytes.double() - 127).float()


@pytest.fixture(scope="module")
def comp(golden_dir: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(golden_dir / "cases.safetensors"))
    return {k[len("comp."):]: v for k, v in tensors.items() if k.startswith("comp.")}


def test_compressed_kv_bytes_are_the_reference_kernels(comp) -> None:
    """The golden fp4_act_quant (E4M3, group 16) bytes, found again from its QDQ output alone."""
    _, row_bytes = store_and_read(COMPRESSED_KV, comp["fp4_act_quant_e4m3_g16.qdq"])
    assert torch.equal(row_bytes[:, :64], comp["fp4_act_quant_e4m3_g16.packed"])
    assert torch.equal(row_bytes[:, 64:], comp["fp4_act_quant_e4m3_g16.s"].view(torch.uint8))


@pytest.mark.parametrize("fmt,key", [(WINDOW_KV, "act_quant"), (INDEX_KEYS, "fp4_act_quant_ue8m0_g32")],
                         ids=["window_kv", "index_keys"])
def test_ue8m0_scale_bytes_are_the_reference_kernels_or_half(comp, fmt: RowFormat, key: str) -> None:
    back, row_bytes = store_and_read(fmt, comp[f"{key}.qdq"])
    assert torch.equal(bits(back), bits(comp[f"{key}.qdq"]))
    ours, theirs = row_bytes[:, -4:].int(), comp[f"{key}.s"].view(torch.uint8).int()
    assert bool(((ours == theirs) | (ours == theirs - 1)).all())


# ----------------------------------------------------------------------------- layout by hand
def test_row_layout() -> None:
    """Codes first (FP4: element 2k in the low nibble), then the scale bytes in group order."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 32] = 1.5, -6.0, 448.0
    window = RowCodec(WINDOW_KV, 64, "cpu").encode(fp8_qdq(x, 32))
    assert window.shape == (1, 66)
    # group 0: maximum 6 -> scale 2**-6 (byte 121), 1.5 -> 96.0 and -6 -> -384.0 in e4m3
    assert window[0, :2].view(torch.float8_e4m3fn).float().tolist() == [96.0, -384.0]
    assert window[0, 64:].tolist() == [121, 127]  # group 1: maximum 448 -> scale 1
    keys = RowCodec(INDEX_KEYS, 64, "cpu").encode(fp4_qdq(x, 32))
    assert keys.shape == (1, 34)
    # group 0 at scale 1: 1.5 is code 3, -6 is code 8 | 7 = 15 -> byte 0xF3
    assert keys[0, 0].item() == 0xF3 and keys[0, 32:].tolist() == [127, 134]  # 448 / 6 -> 2**7
    kv = RowCodec(COMPRESSED_KV, 64, "cpu").encode(fp4_qdq(x, 16, e4m3_scale=True))
    assert kv.shape == (1, 36) and kv[0, 0].item() == 0xF3
    assert kv[0, 32:].view(torch.float8_e4m3fn).float().tolist() == [1.0, 2.0**-9, 72.0, 2.0**-9]


# ----------------------------------------------------------------------------- the cache around them
def test_cache_methods_read_what_was_written(golden_dir: Path) -> None:
    cfg = V41Config.from_pretrained(golden_dir / "checkpoint")
    cache = V41Cache.allocate(cfg, num_blocks=4, num_slots=3, block_size=16)
    gen = torch.Generator().manual_seed(5)
    window = fp8_qdq(torch.randn(5, cfg.head_dim, generator=gen).to(torch.bfloat16), 32)
    slots, rows = torch.tensor([2, 2, 0, 1, 2]), torch.tensor([0, 3, 3, 1, 5])
    cache.write_window(0, slots, rows, window)
    assert torch.equal(bits(cache.read_window(0, slots, rows)), bits(window))
    grid = cache.read_window(0, torch.tensor([[2], [0]]), torch.tensor([[0, 3]]))  # broadcast (slot, row)
    expected = torch.stack([window[:2], torch.stack([torch.zeros_like(window[2]), window[2]])])
    assert torch.equal(bits(grid), bits(expected))  # (slot 0, row 0) was never written
    layer = cfg.kv_source_layers[0]
    kv = fp4_qdq(torch.randn(3, cfg.head_dim, generator=gen).to(torch.bfloat16), 16, e4m3_scale=True)
    keys = fp4_qdq(torch.randn(3, cfg.index_head_dim, generator=gen).to(torch.bfloat16), 32)
    per_block = cache.geometry.entries_per_block(cfg.compress_ratios[layer])
    table, entries = torch.tensor([[1, 3]]), torch.tensor([0, per_block + 1, per_block - 1])
    cache.write_entries_paged(layer, table, torch.zeros(3, dtype=torch.long), entries, kv, keys)
    blocks, rows = cache.entry_rows(layer, table[0], entries)
    assert blocks.tolist() == [1, 3, 1]
    assert torch.equal(bits(cache.read_compressed_kv(layer, blocks, rows)), bits(kv))
    assert torch.equal(bits(cache.read_index_keys(layer, blocks, rows)), bits(keys))
    paged = cache.read_compressed_kv_paged(layer, table, torch.zeros(1, 1, dtype=torch.long), entries.view(1, 3))
    assert torch.equal(bits(paged[0]), bits(kv))
    assert not cache.compressed_kv[layer].data[0].any()  # the padding block is untouched


def test_v41_flash_takes_890_bytes_per_token() -> None:
    """DeepSeek's figure for V4.1-Flash counts the paged cache: per token, the compressed KV (288-byte
    rows) and index keys (68-byte rows) of the kv-source layers 2, 8, 14 (one entry per 2 tokens) and
    20 (one per token). The per-sequence window rings are not in it."""
    cfg = V41Config.from_hf_dict(preset_config("v41-flash", train_tokenizer(129280)))
    assert (COMPRESSED_KV.row_bytes(cfg.head_dim), INDEX_KEYS.row_bytes(cfg.index_head_dim)) == (288, 68)
    assert kv_bytes_per_token(cfg) == 890
    assert bytes_per_block(cfg, 128) == 890 * 128 == 113_920
    window = 40 * 128 * (512 + 16)  # every layer's ring of 128 FP8 rows
    tails = 3 * 2 * (2 * 512 * 4)  # kv and score rows of the three ratio-2 sources, fp32
    assert bytes_per_slot(cfg) == window + tails + 3 * 8 == 2_727_960
