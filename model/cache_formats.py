"""Byte layouts of the KV cache: each cached vector is one row of bytes, its codes then its scales.

The formats are those of the reference's round trips (model/quant.py); a row holds exactly the
codes and scales that give back, on dequantization, the bf16 value the round trip produced:

=============  ==========================  ===========  ==================================================
kind           values                      bytes/row    layout of a row of D values
=============  ==========================  ===========  ==================================================
window KV      FP8 e4m3, UE8M0 scale / 32  D + D/32     D e4m3 bytes, then D/32 UE8M0 bytes
compressed KV  FP4 e2m1, E4M3 scale / 16   D/2 + D/16   D/2 packed bytes, then D/16 e4m3fn bytes
index keys     FP4 e2m1, UE8M0 scale / 32  D/2 + D/32   D/2 packed bytes, then D/32 UE8M0 bytes
=============  ==========================  ===========  ==================================================

A packed byte holds element 2k in its low nibble and 2k+1 in its high nibble (bit 3 of a nibble is
the sign); a UE8M0 byte b stands for 2**(b - 127); scale j covers elements j*group .. j*group+group-1.
For V4.1 (D = 512 for KV, 128 for index keys) that is 528, 288 and 68 bytes per row. An all-zero
row (never written) reads back as zeros.

Writing takes the values *after* their round trip and finds their codes and scales again with the
round trip's own quantization arithmetic; reading multiplies codes by scales, which is exact in
bf16 (at most 6 significant bits), so it equals the round trip's ``bf16(float(code) * scale)``.
Re-quantizing a round-trip output gives back the same values (tests/test_cache_formats.py checks
every bf16 group maximum), and the same bytes with two exceptions:

* two encodings of one value: a UE8M0 group whose largest code is the smallest the scale allows
  (FP8 224, FP4 3) has the same values at half the scale with doubled codes (FP8 448, FP4 6); the
  quantizer, given those values, picks the half scale. Either is a valid encoding; which one the
  reference's own bytes have depends on the value before the round trip, which the cache never sees.
* compressed KV at scale 2**-8 with largest code 4 (group maximum 2**-6, before the round trip in
  [9, 10) * 2**-9): the E4M3 scale of 2**-6 / 6 rounds to 2**-9 and would clip that code to 6, so the
  writer keeps 2**-8 for that one group maximum (no other encoding produces it).

Values that the round trip itself took to infinity (group maxima above about 2.9e38, where the
largest code rounds up past the top of fp32's range) cannot be stored; they read back as NaN.

The decode tables live on the cache's device (the quantizer's constants are model/quant.py's, which
keeps one device copy of each) and nothing here waits for the host, so reads and writes can be
captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from .quant import E2M1_SIGNED, FP4_MAX, e2m1_codes, fp4_scale, fp8_scale, pack_e2m1, to_e4m3

# the one compressed-KV group maximum whose E4M3 scale the quantizer would not find again
_AMBIGUOUS_E4M3_AMAX = 2.0**-6
_AMBIGUOUS_E4M3_SCALE = 2.0**-8


class ElementFormat(Enum):
    FP8_E4M3 = "fp8 e4m3"
    FP4_E2M1 = "fp4 e2m1"


class ScaleFormat(Enum):
    UE8M0 = "UE8M0"
    E4M3 = "E4M3"


@dataclass(frozen=True)
class RowFormat:
    """How one cached vector is stored: element codes, then one scale byte per ``group`` values."""

    element: ElementFormat
    group: int
    scale: ScaleFormat

    def code_bytes(self, width: int) -> int:
        return width if self.element is ElementFormat.FP8_E4M3 else width // 2

    def scale_bytes(self, width: int) -> int:
        return width // self.group

    def row_bytes(self, width: int) -> int:
        return self.code_bytes(width) + self.scale_bytes(width)

    def describe(self) -> str:
        return f"{self.element.value} ({self.scale.value} scale per {self.group})"


WINDOW_KV = RowFormat(ElementFormat.FP8_E4M3, 32, ScaleFormat.UE8M0)
COMPRESSED_KV = RowFormat(ElementFormat.FP4_E2M1, 16, ScaleFormat.E4M3)
INDEX_KEYS = RowFormat(ElementFormat.FP4_E2M1, 32, ScaleFormat.UE8M0)


def _ue8m0_table() -> torch.Tensor:
    """[256, 1] bf16: the value of each UE8M0 byte, 2**(b - 127); 255 is NaN (2**-127 is a bf16 subnormal)."""
    values = torch.exp2(torch.arange(256, dtype=torch.float64) - 127)
    values[255] = torch.nan
    return values.to(torch.bfloat16).unsqueeze(-1)


def _e2m1_pair_table() -> torch.Tensor:
    """[256, 2] bf16: the two values a packed byte holds (low nibble first)."""
    byte = torch.arange(256)
    return torch.stack([E2M1_SIGNED[byte & 0x0F], E2M1_SIGNED[byte >> 4]], dim=-1).to(torch.bfloat16)


class RowCodec:
    """Quantize bf16 rows of ``width`` values into ``fmt`` rows of bytes and back, on ``device``."""

    def __init__(self, fmt: RowFormat, width: int, device: torch.device | str):
        if width % fmt.group or width % 2:
            raise ValueError(f"a row of {width} values does not split into groups of {fmt.group}")
        self.fmt, self.width = fmt, width
        self.code_bytes, self.row_bytes = fmt.code_bytes(width), fmt.row_bytes(width)
        self.fp8 = fmt.element is ElementFormat.FP8_E4M3
        self.ue8m0 = fmt.scale is ScaleFormat.UE8M0
        self._ue8m0_values = _ue8m0_table().to(device)
        self._e2m1_pairs = _e2m1_pair_table().to(device)

    # ------------------------------------------------------------------ write
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """bf16 [..., width] (round-trip outputs) -> uint8 rows [..., row_bytes]."""
        assert values.dtype == torch.bfloat16 and values.shape[-1] == self.width, (values.dtype, values.shape)
        groups = values.float().unflatten(-1, (-1, self.fmt.group))
        amax = groups.abs().amax(dim=-1)
        scale = self._scale(amax)
        scaled = groups / scale.unsqueeze(-1)
        if self.fp8:
            codes = to_e4m3(scaled).flatten(-2).view(torch.uint8)
        else:
            codes = pack_e2m1(e2m1_codes(scaled.clamp(-FP4_MAX, FP4_MAX)).flatten(-2))
        if self.ue8m0:  # a positive power of two: its byte is the fp32 exponent field
            scale_bytes = (scale.view(torch.int32) >> 23).to(torch.uint8)
        else:
            scale_bytes = to_e4m3(scale).view(torch.uint8)
        return torch.cat([codes, scale_bytes], dim=-1)

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        """fp32 scale of every group, as the round trip computes it from the group maximum."""
        if self.fp8:
            return fp8_scale(amax)
        scale = fp4_scale(amax, e4m3_scale=not self.ue8m0)
        if self.ue8m0:
            return scale
        return torch.where(amax == _AMBIGUOUS_E4M3_AMAX, _AMBIGUOUS_E4M3_SCALE, scale)

    # ------------------------------------------------------------------ read
    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 rows [..., row_bytes] -> bf16 values [..., width] (a new tensor)."""
        codes, scale_bytes = rows[..., : self.code_bytes], rows[..., self.code_bytes:]
        if self.fp8:
            values = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
        else:  # a table lookup per byte; embedding is the fastest gather of small rows on CPU
            values = F.embedding(codes.int(), self._e2m1_pairs).flatten(-2)
        if self.ue8m0:
            scale = F.embedding(scale_bytes.int(), self._ue8m0_values).squeeze(-1)
        else:
            scale = scale_bytes.view(torch.float8_e4m3fn).to(torch.bfloat16)
        # code x scale is exact in bf16, so this equals the round trip's bf16(float(code) * scale)
        values.unflatten(-1, (-1, self.fmt.group)).mul_(scale.unsqueeze(-1))
        return values


class QuantizedRows:
    """A tensor of rows ``[*shape, width]`` held as ``fmt`` bytes ``data [*shape, row_bytes]``.

    On CUDA a read (write) is one Triton kernel that gathers and decodes (encodes and scatters) the
    rows, ``model/kernels/triton_cache_codec.py``: the codec's arithmetic bit for bit, in one launch
    instead of the ~13 (~25) torch kernels of ``RowCodec``; a decode step reads and writes three
    caches per layer."""

    def __init__(self, codec: RowCodec, shape: tuple[int, ...], device: torch.device | str):
        self.codec = codec
        self.data = torch.zeros(*shape, codec.row_bytes, dtype=torch.uint8, device=device)
        self.fused = self.data.is_cuda

    def read(self, *index: torch.Tensor) -> torch.Tensor:
        """bf16 rows at ``data[index]`` (advanced indexing over the leading dims)."""
        if not self.fused:
            return self.codec.decode(self.data[index])
        return self.read_rows(self.flat_rows(*index))

    def write(self, *index: torch.Tensor, values: torch.Tensor) -> None:
        if not self.fused:
            self.data[index] = self.codec.encode(values)
            return
        self.write_rows(self.flat_rows(*index), values)

    def read_entries(self, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 rows ``[S, K, width]`` of a ``[blocks, per_block]`` store at paged entries: entries
        ``entries`` of sequences ``seq`` (broadcast to ``[S, K]``) through the padded block tables
        ``tables [B, W]`` (``entry_rows``; into ``out``, contiguous, if given). On CUDA the kernel finds
        the rows itself (no index launches)."""
        if not self.fused:
            return _into(self.read(*self.entry_rows(tables, seq, entries)), out)
        from .kernels.triton_cache_codec import read_entries

        return read_entries(self.data, tables, seq, entries, self.codec.fmt, self.codec.width, out)

    def write_entries(self, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor,
                      values: torch.Tensor) -> None:
        """Write ``values [S, K, width]`` at paged entries (``read_entries``)."""
        if not self.fused:
            self.write(*self.entry_rows(tables, seq, entries), values=values)
            return
        from .kernels.triton_cache_codec import write_entries

        write_entries(self.data, tables, seq, entries, values, self.codec.fmt)

    def entry_rows(self, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor):
        """(block, row) of paged entries ``entries`` (>= 0) of sequences ``seq`` in a ``[blocks,
        per_block]`` store, given the padded block tables ``[B, W]``: entries past a sequence's table
        land in its last column's block (callers mask them out)."""
        per_block = self.data.shape[1]
        column = (entries // per_block).clamp(max=tables.shape[1] - 1)
        return tables[seq, column], entries % per_block

    def read_rows(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 rows ``[*rows.shape, width]`` at row numbers ``rows`` of ``data`` seen as ``[N, row_bytes]``
        (``flat_rows``: numbers that stores of one shape share, computed once for all of them; into ``out``,
        contiguous, if given)."""
        width = self.codec.width
        if not self.fused:
            return _into(self.codec.decode(self.data.view(-1, self.codec.row_bytes)[rows]), out)
        from .kernels.triton_cache_codec import read_rows

        return read_rows(self.data, rows.reshape(-1), self.codec.fmt, width, out).view(*rows.shape, width)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values [*rows.shape, width]`` (``rows`` broadcast to their leading shape) at row numbers ``rows``."""
        rows = rows.expand(values.shape[:-1])
        if not self.fused:
            self.data.view(-1, self.codec.row_bytes)[rows] = self.codec.encode(values)
            return
        from .kernels.triton_cache_codec import write_rows

        write_rows(self.data, rows.reshape(-1), values.reshape(-1, values.shape[-1]), self.codec.fmt)

    def flat_rows(self, *index: torch.Tensor) -> torch.Tensor:
        """The numbers of the rows ``data[index]`` selects in ``data`` seen as ``[N, row_bytes]``
        (shaped as the broadcast index, as advanced indexing would)."""
        flat = None
        for dim in reversed(range(len(index))):  # the innermost first: its step is usually one row
            position, rows_per_step = index[dim].long(), self.data.stride(dim) // self.codec.row_bytes
            if flat is None:
                flat = position if rows_per_step == 1 else position * rows_per_step
            else:  # one launch for the product and the sum (integers: exact in any order)
                flat = torch.add(flat, position, alpha=rows_per_step)
        return flat


@dataclass(frozen=True)
class RowsWrite:
    """Values still to be made, and where a cache store keeps them: ``store``'s rows ``rows``
    (``QuantizedRows.write_rows``). Handed to the code that makes the values (``KernelBackend.window_kv``), so
    that a kernel may encode and store them in the launch that makes them; calling it writes them apart."""

    store: QuantizedRows
    rows: torch.Tensor

    def __call__(self, values: torch.Tensor) -> None:
        self.store.write_rows(self.rows, values)


def _into(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``rows``, or ``out`` (as many values) holding them."""
    if out is None:
        return rows
    return out.view(rows.shape).copy_(rows)
