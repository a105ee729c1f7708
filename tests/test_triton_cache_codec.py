"""The cache-row kernels (``model/kernels/triton_cache_codec.py``) against the torch codec, byte for byte.

Without a GPU they run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``) on CPU
tensors, on the GPU on CUDA tensors. Both directions are exact arithmetic, so the check is
equality: the bytes written are ``RowCodec.encode``'s, the values read are ``RowCodec.decode``'s
(and so the round-trip values written), for every positive finite bf16 value as a group maximum
(every scale each format can take), for the corner values of ``test_cache_formats.py`` (signed
zeros, subnormals, ties, the ambiguous compressed-KV maximum) and for rows never written.
``QuantizedRows`` takes this path on CUDA; here it is switched on by hand on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.cache_formats import QuantizedRows, RowCodec  # noqa: E402
from tests.test_cache_formats import (FORMAT_IDS, FORMATS, ROUND_TRIPS, SPECIAL, WIDTH, bits,  # noqa: E402
                                      every_group_maximum)
from tests.kernel_checks import device  # noqa: E402


def corner_rows(fmt, seed: int) -> torch.Tensor:
    """Round-trip rows of corner values and random values over many magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (256, WIDTH), generator=gen)]
    scales = torch.exp2(torch.randint(-140, 100, (256, 1), generator=gen).float())
    mixed = torch.where(torch.rand(256, WIDTH, generator=gen) < 0.5, special, torch.randn(256, WIDTH, generator=gen))
    x = (mixed.double() * scales.double()).clamp(-3e38, 3e38).float().bfloat16()
    x[0] = 0.0
    x[1] = -0.0
    x[2, :fmt.group] = 2.0 ** -6  # the ambiguous compressed-KV maximum
    y = ROUND_TRIPS[fmt][0](x)
    return y[torch.isfinite(y.float()).all(-1)]


def kernel_store(fmt, values: torch.Tensor, where: torch.Tensor, rows: int) -> torch.Tensor:
    from model.kernels.triton_cache_codec import write_rows

    data = torch.zeros(rows, fmt.row_bytes(WIDTH), dtype=torch.uint8, device=device())
    write_rows(data, where.to(device()), values.to(device()), fmt)
    return data


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("values", ["every group maximum", "corners"])
def test_write_and_read_are_the_codecs_byte_for_byte(fmt, values):
    from model.kernels.triton_cache_codec import read_rows

    y = ROUND_TRIPS[fmt][0](every_group_maximum(fmt)) if values == "every group maximum" else corner_rows(fmt, 1)
    y = y[torch.isfinite(y.float()).all(-1)]
    codec = RowCodec(fmt, WIDTH, "cpu")
    where = torch.randperm(y.shape[0], generator=torch.Generator().manual_seed(2)) + 3  # rows 0-2 stay unwritten
    data = kernel_store(fmt, y, where, y.shape[0] + 3)
    assert torch.equal(data[where].cpu(), codec.encode(y))
    back = read_rows(data, where.to(device()), fmt, WIDTH).cpu()
    assert torch.equal(bits(back), bits(y))
    unwritten = read_rows(data, torch.arange(3, device=device()), fmt, WIDTH).cpu()
    assert torch.equal(bits(unwritten), bits(torch.zeros(3, WIDTH, dtype=torch.bfloat16)))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 3])
def test_a_few_rows_take_a_program_of_their_size_and_the_same_bytes(fmt, rows):
    """A decode step writes one row per sequence: programs then hold as many rows as there are."""
    from model.kernels.triton_cache_codec import _constants, read_rows

    assert _constants(fmt, WIDTH, rows)["BLOCK_ROWS"] == triton.next_power_of_2(rows)
    y = corner_rows(fmt, 1)[:rows]
    where = torch.arange(rows) * 2 + 1
    data = kernel_store(fmt, y, where, 2 * rows + 1)
    assert torch.equal(data[where].cpu(), RowCodec(fmt, WIDTH, "cpu").encode(y))
    assert torch.equal(bits(read_rows(data, where.to(device()), fmt, WIDTH).cpu()), bits(y))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantized_rows_fused_path_indexes_like_the_torch_path(fmt):
    """A [slots, ring] store read and written at broadcast (slot [T, 1], row [T, W]) index pairs."""
    plain = QuantizedRows(RowCodec(fmt, WIDTH, "cpu"), (5, 16), "cpu")
    fused = QuantizedRows(RowCodec(fmt, WIDTH, device()), (5, 16), device())
    fused.fused = True  # QuantizedRows' choice on CUDA; here also in the interpreter
    slots = torch.tensor([[3], [0], [4]])
    rows = torch.tensor([[1, 2, 15, 0], [5, 6, 7, 8], [9, 3, 2, 11]])
    values = corner_rows(fmt, 3)[:12].view(3, 4, WIDTH)
    plain.write(slots, rows, values=values)
    fused.write(slots.to(device()), rows.to(device()), values=values.to(device()))
    assert torch.equal(fused.data.cpu(), plain.data)
    wide = torch.arange(16).expand(3, 16)
    got = fused.read(slots.to(device()), wide.to(device())).cpu()
    assert got.shape == (3, 16, WIDTH)
    assert torch.equal(bits(got), bits(plain.read(slots, wide)))
    nothing = torch.zeros(0, 1, dtype=torch.long)  # a step without entries to read or write
    assert fused.read(nothing.to(device()), nothing.to(device())).shape == plain.read(nothing, nothing).shape
    fused.write(nothing.to(device()), nothing.to(device()), values=torch.zeros(0, 1, WIDTH).bfloat16().to(device()))
    assert torch.equal(fused.data.cpu(), plain.data)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_paged_entries_find_the_rows_the_torch_path_finds(fmt):
    """Reads and writes through the block tables (the kernel finds each entry's block and row) against
    the torch path's (block, row) pairs: per-query entries [T, K] with seq [T, 1], one range of
    entries for every sequence ([E] with [B, 1]), new entries [1, G], and entries past a table."""
    plain = QuantizedRows(RowCodec(fmt, WIDTH, "cpu"), (7, 4), "cpu")  # 7 blocks of 4 entries
    fused = QuantizedRows(RowCodec(fmt, WIDTH, device()), (7, 4), device())
    fused.fused = True
    tables = torch.tensor([[3, 5, 0], [1, 0, 0], [6, 2, 4]])  # padded with block 0
    seq = torch.tensor([0, 2, 1, 2, 0, 2])
    entries = torch.tensor([0, 9, 3, 1, 5, 11])  # sequence 2's entry 11: its third block, row 3
    values = corner_rows(fmt, 5)[:6].unsqueeze(0)
    on = lambda t: t.to(device())  # noqa: E731
    plain.write_entries(tables, seq.view(1, -1), entries.view(1, -1), values)
    fused.write_entries(on(tables), on(seq.view(1, -1)), on(entries.view(1, -1)), on(values))
    assert torch.equal(fused.data.cpu(), plain.data)
    # sequence 2's entry 13 is past its table: it lands in the last column's block (4), on entry 9's row
    queries = (torch.tensor([[2], [0], [1]]), torch.tensor([[11, 0, 9, 13], [5, 1, 0, 2], [3, 0, 1, 2]]))
    every = (torch.arange(3).unsqueeze(-1), torch.arange(12))
    for seq_of, entries_of in (queries, every):
        got = fused.read_entries(on(tables), on(seq_of), on(entries_of)).cpu()
        want = plain.read_entries(tables, seq_of, entries_of)
        assert got.shape == want.shape == (*torch.broadcast_shapes(seq_of.shape, entries_of.shape), WIDTH)
        assert torch.equal(bits(got), bits(want))
    back = plain.read_entries(tables, torch.tensor([[2]]), torch.tensor([[11, 13]]))[0]
    assert torch.equal(bits(back), bits(values[0, [5, 1]]))  # the reference path: what was written comes back


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model; on CUDA every cache takes this path")
def test_the_model_gives_the_same_bits_through_the_cache_kernels(tiny_model, run_sequence, monkeypatch):
    """The tiny model, prefill then decode steps, with every cache read and write through the kernels
    (in the interpreter): the same logits, bit for bit, as through the torch codec."""
    prompt, steps = [(7 * i + 3) % 500 for i in range(40)], [11, 12, 13, 14, 15]
    plain = run_sequence(tiny_model, prompt, steps)
    original = QuantizedRows.__init__

    def fused_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fused = True

    monkeypatch.setattr(QuantizedRows, "__init__", fused_init)
    fused = run_sequence(tiny_model, prompt, steps)
    assert torch.equal(fused.prefill, plain.prefill) and torch.equal(fused.steps, plain.steps)


@pytest.mark.parametrize("fused_path", [False, True], ids=["torch", "kernel"])
def test_reads_into_a_buffer_write_there_and_nowhere_else(fused_path):
    """``read_rows(out=)`` and ``read_entries(out=)``: the attention decodes the rings and the compressed
    entries straight into its pool of rows. The rows land in ``out`` (a slice of a larger buffer), equal to
    what a read without ``out`` returns, and nothing around the slice changes."""
    fmt = FORMATS[0]
    store = QuantizedRows(RowCodec(fmt, WIDTH, device()), (7, 4), device())
    store.fused = fused_path  # QuantizedRows' choice on CUDA; here also in the interpreter
    on = lambda t: t.to(device())  # noqa: E731
    store.write(on(torch.arange(7).unsqueeze(-1)), on(torch.arange(4).expand(7, 4)),
                values=on(corner_rows(fmt, 9)[:28].view(7, 4, WIDTH)))
    buffer = torch.full((20, WIDTH), 3.0, dtype=torch.bfloat16, device=device())
    rows = on(torch.tensor([[5, 2, 27]]))
    got = store.read_rows(rows, out=buffer[2:5])
    assert got.data_ptr() == buffer[2:5].data_ptr() and torch.equal(bits(got), bits(store.read_rows(rows)))
    tables, seq, entries = on(torch.tensor([[3, 5], [6, 0]])), on(torch.tensor([[1], [0]])), on(torch.tensor([[0, 2]]))
    got = store.read_entries(tables, seq, entries, out=buffer[7:11])
    assert got.data_ptr() == buffer[7:11].data_ptr()
    assert torch.equal(bits(got), bits(store.read_entries(tables, seq, entries)))
    untouched = torch.cat([buffer[:2], buffer[5:7], buffer[11:]])
    assert bool((untouched == 3.0).all())
