"""Triton kernels that read and write KV-cache rows in their byte formats (twin: ``model.cache_formats.RowCodec``).

``read_rows(data, flat_rows, fmt, width)``: the rows ``data[flat_rows]`` of a cache's bytes (``data``
viewed as ``[N, row_bytes]``) decoded to bf16 ``[M, width]``; ``write_rows(data, flat_rows, values,
fmt)``: bf16 rows (round-trip outputs) encoded and stored at those rows. Both are the codec's exact
arithmetic bit for bit (see ``cache_formats.py`` for the formats and the two documented encoding
choices, which the writer makes the same way):

* read: each code times its group's scale, computed in fp32 and rounded to bf16 (exact: at most
  six significant bits), with the sign on the bits (so -0.0 stays -0.0);
* write: the group maximum, the scale from it (UE8M0: 2**ceil(log2(max(amax, floor) * fp32(1 /
  code max))) off the bits; E4M3: ``e4m3(max(amax, 6 * 2**-9) / 6)``, except 2**-8 at the ambiguous
  maximum 2**-6), the values divided by it (IEEE), then FP8: clamped to +-448 and rounded to e4m3
  (nearest even); FP4: clamped to +-6 and rounded to the nearest e2m1 code (ties to the even code).

Why kernels: a read was the gather plus ~12 torch kernels (table lookups, casts, the scale product)
and a write ~25 (the scale arithmetic, the code search, packing, the concatenation, the scatter);
each layer of a decode step reads and writes three caches. Here one launch gathers or scatters and
converts, so the decoded rows are written once and the bytes never pass through intermediates.

Paged entries (``read_entries`` / ``write_entries``): instead of row numbers, the compressed entries
``entries [S, K]`` (int64, >= 0) of sequences ``seq [S, K]`` (both may be broadcast views, stride 0)
through the batch's padded block tables ``[B, W]``: entry ``e`` of sequence ``b`` is row ``e %
per_block`` of block ``tables[b, min(e // per_block, W - 1)]`` (``QuantizedRows.entry_rows``, the
torch path). The kernel does that integer work itself: in torch it was ~5 launches per read or write
(divisions, a clamp, a gather, the flat row), each ~1-2 µs inside a decode step's CUDA graph.

Layouts: ``data`` uint8 rows of ``row_bytes`` (codes, then scale bytes), ``flat_rows`` int64 ``[M]``,
values bf16 ``[M, width]``; ``width`` a power of two, a multiple of the group. Rows are independent
(writes to one row from two programs race; the engine writes a row once per step, except its
scratch row, which is never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cache_formats import ElementFormat, RowFormat, ScaleFormat
from .triton_common import bf16_bits_to_f32, e2m1_code, e2m1_value, fp4_scale, pow2_scale, round_to_e4m3

BLOCK_ELEMENTS = 4096  # values per program
FP8_FLOOR = tl.constexpr(1e-4)  # the FP8 scale's floor on the group maximum (quant.fp8_scale)
FP8_MAX_INV = tl.constexpr(1.0 / 448.0)
AMBIGUOUS_AMAX = tl.constexpr(2.0 ** -6)  # cache_formats._AMBIGUOUS_E4M3_AMAX
AMBIGUOUS_SCALE = tl.constexpr(2.0 ** -8)


# ----------------------------------------------------------------------------------- bytes -> values
@triton.jit
def _e4m3_value(byte):
    """e4m3fn byte (int32, 0..255) -> fp32 value; 0x7F / 0xFF are NaN."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    magnitude = tl.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    return (magnitude.to(tl.int32, bitcast=True) | ((byte >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_value(byte):
    """UE8M0 byte -> 2**(byte - 127) (2**-127 is an fp32 subnormal; 255 is NaN)."""
    value = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), value)


@triton.jit
def _bf16_bits(x):
    """fp32 -> the bits of the nearest bf16 (ties to even), as int16: stored through an int16 view,
    so that no float conversion can flush a subnormal (Triton's interpreter does)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _data_rows(rows, mask, rows_ptr, pages, PAGED: tl.constexpr):
    """Row numbers in ``data`` of the kernel's rows ``rows``: loaded from ``rows_ptr``, or (``PAGED``)
    found through the block tables, ``pages`` = (tables, table stride, table columns, seq, its two
    strides, entries, their two strides, K, entries per block, rows per block)."""
    if PAGED:  # (an else branch: code after a constexpr branch's return would still be compiled)
        tables, stride_table, columns, seq, seq_s, seq_k, entry, entry_s, entry_k, K, per_block, rows_per_block = pages
        s, k = rows // K, rows % K
        b = tl.load(seq + s * seq_s + k * seq_k, mask=mask, other=0)
        e = tl.load(entry + s * entry_s + k * entry_k, mask=mask, other=0)
        block = tl.load(tables + b * stride_table + tl.minimum(e // per_block, columns - 1), mask=mask, other=0)
        found = block * rows_per_block + e % per_block
    else:
        found = tl.load(rows_ptr + rows, mask=mask, other=0)
    return found


@triton.jit
def _read_rows_kernel(data_ptr, rows_ptr, out_ptr, M, pages, ROW_BYTES: tl.constexpr, CODE_BYTES: tl.constexpr,
                      FP8: tl.constexpr, UE8M0: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, PAGED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = rows < M
    source = data_ptr + _data_rows(rows, mask, rows_ptr, pages, PAGED)[:, None] * ROW_BYTES  # [R, 1]
    cols = tl.arange(0, WIDTH)[None, :]
    if FP8:
        value = _e4m3_value(tl.load(source + cols, mask=mask[:, None], other=0).to(tl.int32))
    else:
        packed = tl.load(source + cols // 2, mask=mask[:, None], other=0).to(tl.int32)
        value = e2m1_value(tl.where(cols % 2 == 0, packed & 15, packed >> 4))  # element 2k: low nibble
    scale_byte = tl.load(source + CODE_BYTES + cols // GROUP, mask=mask[:, None], other=0).to(tl.int32)
    scale = _ue8m0_value(scale_byte) if UE8M0 else _e4m3_value(scale_byte)
    out = _bf16_bits(value * scale)  # exact but where the product leaves bf16's range
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * WIDTH + cols, out, mask=mask[:, None])


# ----------------------------------------------------------------------------------- values -> bytes
@triton.jit
def _e4m3_byte(q):
    """An fp32 e4m3 value (finite, |q| <= 448; -0.0 kept) -> its e4m3fn byte (int32)."""
    bits = q.to(tl.int32, bitcast=True)
    magnitude = tl.abs(q)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    subnormal = (magnitude * 512.0).to(tl.int32)  # a multiple of 2**-9, exact
    return tl.where(magnitude < 0.015625, subnormal, normal) | (((bits >> 31) & 1) << 7)


@triton.jit
def _scale_byte(scale, UE8M0: tl.constexpr):
    """A group's scale (a positive power of two under UE8M0, else an e4m3 value) -> its byte (int32)."""
    if UE8M0:  # the byte is the fp32 exponent field
        scale_bytes = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    else:
        scale_bytes = _e4m3_byte(scale)
    return scale_bytes


@triton.jit
def fp8_group_bytes(groups, UE8M0: tl.constexpr):
    """fp32 ``groups [R, G, GROUP]`` (bf16 values) -> (e4m3 bytes ``[R, G, GROUP]``, scale bytes ``[R, G]``),
    int32, as the writer encodes an FP8 row: each group's power-of-two scale from its maximum, the values
    divided by it, clamped and rounded to e4m3. A kernel that makes FP8 cache rows stores them with it
    (``triton_window_kv``)."""
    scale = pow2_scale(tl.max(tl.abs(groups), axis=2), FP8_FLOOR, FP8_MAX_INV)
    scaled = tl.div_rn(groups, scale[:, :, None])
    return _e4m3_byte(round_to_e4m3(tl.minimum(tl.maximum(scaled, -448.0), 448.0))), _scale_byte(scale, UE8M0)


@triton.jit
def _write_rows_kernel(values_ptr, rows_ptr, data_ptr, M, stride_v, pages, ROW_BYTES: tl.constexpr,
                       CODE_BYTES: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr, WIDTH: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, PAGED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = rows < M
    cols = tl.arange(0, WIDTH)
    x = bf16_bits_to_f32(tl.load(values_ptr + rows.to(tl.int64)[:, None] * stride_v + cols[None, :],
                                 mask=mask[:, None], other=0))
    groups = tl.reshape(x, (BLOCK_ROWS, WIDTH // GROUP, GROUP))
    target = data_ptr + _data_rows(rows, mask, rows_ptr, pages, PAGED)[:, None] * ROW_BYTES  # [R, 1]
    if FP8:
        codes, scale_bytes = fp8_group_bytes(groups, UE8M0)
        tl.store(target + cols[None, :], tl.reshape(codes, (BLOCK_ROWS, WIDTH)).to(tl.uint8), mask=mask[:, None])
    else:
        amax = tl.max(tl.abs(groups), axis=2)
        if UE8M0:
            scale = fp4_scale(amax, False)
        else:
            scale = tl.where(amax == AMBIGUOUS_AMAX, AMBIGUOUS_SCALE, fp4_scale(amax, True))
        scaled = tl.div_rn(groups, scale[:, :, None])
        codes = tl.reshape(e2m1_code(tl.minimum(tl.maximum(scaled, -6.0), 6.0)), (BLOCK_ROWS, WIDTH // 2, 2))
        low, high = tl.split(codes)
        pairs = tl.arange(0, WIDTH // 2)
        tl.store(target + pairs[None, :], (low | (high << 4)).to(tl.uint8), mask=mask[:, None])
        scale_bytes = _scale_byte(scale, UE8M0)
    groups_index = tl.arange(0, WIDTH // GROUP)
    tl.store(target + CODE_BYTES + groups_index[None, :], scale_bytes.to(tl.uint8), mask=mask[:, None])


# ----------------------------------------------------------------------------------- launchers
def _constants(fmt: RowFormat, width: int, rows: int | None = None) -> dict:
    """The kernels' constants for ``rows`` rows of ``width`` values: up to ``BLOCK_ELEMENTS`` values per
    program, but no more rows than there are (a decode step writes one row per sequence: a program of
    eight rows would encode seven masked ones; rows are encoded alone, so this changes no byte)."""
    assert width & (width - 1) == 0 and width % fmt.group == 0, (width, fmt)
    block_rows = max(1, BLOCK_ELEMENTS // width)
    if rows is not None:
        block_rows = min(block_rows, triton.next_power_of_2(max(rows, 1)))
    return dict(ROW_BYTES=fmt.row_bytes(width), CODE_BYTES=fmt.code_bytes(width),
                FP8=fmt.element is ElementFormat.FP8_E4M3, UE8M0=fmt.scale is ScaleFormat.UE8M0, WIDTH=width,
                GROUP=fmt.group, BLOCK_ROWS=block_rows)


def read_rows(data: torch.Tensor, flat_rows: torch.Tensor, fmt: RowFormat, width: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``flat_rows [M]`` of ``data`` (contiguous uint8, rows of ``fmt.row_bytes(width)``) -> bf16
    ``[M, width]`` (into ``out``, contiguous, if given)."""
    return _read(data, flat_rows.reshape(-1), flat_rows.numel(), _NOT_PAGED, fmt, width, out)


def write_rows(data: torch.Tensor, flat_rows: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> None:
    """Encode bf16 ``values [M, width]`` and store them at rows ``flat_rows [M]`` of ``data``."""
    _write(data, flat_rows.reshape(-1), values, _NOT_PAGED, fmt)


def read_entries(data: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor,
                 fmt: RowFormat, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The paged entries (module docstring) of ``data [blocks, per_block, row_bytes]`` -> bf16
    ``[S, K, width]``, ``[S, K]`` the broadcast shape of ``seq`` and ``entries`` (2-D; into ``out``,
    contiguous, if given)."""
    pages, shape = _pages(data, tables, seq, entries)
    return _read(data, tables, shape[0] * shape[1], pages, fmt, width, out).view(*shape, width)


def write_entries(data: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor,
                  values: torch.Tensor, fmt: RowFormat) -> None:
    """Encode bf16 ``values [S, K, width]`` (or ``[S * K, width]``) and store them at the paged entries."""
    pages, shape = _pages(data, tables, seq, entries)
    _write(data, tables, values.reshape(shape[0] * shape[1], values.shape[-1]), pages, fmt)


_NOT_PAGED = (0,) * 12  # the kernels' ``pages`` argument when they are given row numbers


def _pages(data: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor, entries: torch.Tensor):
    """The kernels' ``pages`` argument and the broadcast ``[S, K]`` of seq and entries."""
    shape = torch.broadcast_shapes(seq.shape, entries.shape)
    if len(shape) != 2 or data.dim() != 3 or data.stride(1) != data.shape[2]:
        raise ValueError(f"paged entries take 2-D indices and a [blocks, per_block, bytes] store, got {tuple(shape)}, "
                         f"{tuple(data.shape)}")
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    seq, entries = seq.expand(shape), entries.expand(shape)
    pages = (tables, tables.stride(0), tables.shape[1], seq, *seq.stride(), entries, *entries.stride(), shape[1],
             data.shape[1], data.stride(0) // data.shape[2])
    return pages, shape


def _read(data, rows, m: int, pages, fmt: RowFormat, width: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(m, width, dtype=torch.bfloat16, device=data.device)
    out = out.view(m, width)  # (a view of a contiguous buffer: the kernel writes rows of ``width`` in turn)
    if m:
        constants = _constants(fmt, width, m)
        _read_rows_kernel[(triton.cdiv(m, constants["BLOCK_ROWS"]),)](
            data, rows, out.view(torch.int16), m, pages, **constants, PAGED=pages is not _NOT_PAGED, num_warps=4)
    return out


def _write(data, rows, values: torch.Tensor, pages, fmt: RowFormat) -> None:
    m, width = values.shape
    if m:
        values = values if values.stride(-1) == 1 else values.contiguous()
        constants = _constants(fmt, width, m)
        _write_rows_kernel[(triton.cdiv(m, constants["BLOCK_ROWS"]),)](
            values.view(torch.int16), rows, data, m, values.stride(0), pages, **constants,
            PAGED=pages is not _NOT_PAGED, num_warps=4)
