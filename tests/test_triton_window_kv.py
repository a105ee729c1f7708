"""The attention's KV rows in one launch (``model/kernels/triton_window_kv.py``) against the three
launches it replaces (``triton_rms_norm``, ``triton_rope``, the FP8 round trip), each of which its own
test holds against its twin.

Without a GPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``). The
fused kernel does each step's arithmetic in the same order, so the check is bit for bit.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.cache_formats import WINDOW_KV, QuantizedRows, RowCodec, RowsWrite  # noqa: E402
from model.kernels import triton_window_kv  # noqa: E402
from model.kernels.backend import KernelBackend  # noqa: E402
from model.kernels.triton_backend import TritonKernels  # noqa: E402
from model.rope import RotaryTable, rope_frequencies  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def rope_table(dims: int) -> RotaryTable:
    return RotaryTable(rope_frequencies(dims, 10000.0, 1.0, 0, 32, 1), 4096, device())


@pytest.mark.parametrize("rows,d,rope_dims", [(1, 512, 64), (7, 512, 64), (3, 128, 32), (2, 96, 32)])
def test_one_launch_gives_the_three_launches_bits(rows, d, rope_dims, monkeypatch):
    gen = torch.Generator().manual_seed(rows + d)
    kv = (torch.randn(rows, d, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).bfloat16().to(device())
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16().to(device())
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(device())
    rope = rope_table(rope_dims)
    kernels = TritonKernels()
    three = KernelBackend.window_kv(kernels, kv, weight, 1e-6, positions, rope, rope_dims)  # the three launches
    one = triton_window_kv.window_kv(kv, weight, 1e-6, positions, rope.table)
    assert torch.equal(one.view(torch.int16), three.view(torch.int16))
    launches = []  # the backend takes the one launch for these rows
    real = triton_window_kv.window_kv
    monkeypatch.setattr(triton_window_kv, "window_kv",
                        lambda *args, **options: launches.append(1) or real(*args, **options))
    assert torch.equal(kernels.window_kv(kv, weight, 1e-6, positions, rope, rope_dims), one)
    assert launches == [1]


def test_rows_whose_rope_part_splits_a_group_take_the_three_launches():
    """The tiny models' 16 rope dims share a group of 32 with unrotated dims: the one-launch kernel does
    not take them, and the backend runs the three steps."""
    assert not triton_window_kv.takes(64, 16) and triton_window_kv.takes(512, 64)
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 64, generator=gen).bfloat16().to(device())
    weight = torch.ones(64, dtype=torch.bfloat16, device=device())
    positions = torch.tensor([5, 9], device=device())
    rope, kernels = rope_table(16), TritonKernels()
    expected = KernelBackend.window_kv(kernels, kv, weight, 1e-6, positions, rope, 16)
    assert torch.equal(kernels.window_kv(kv, weight, 1e-6, positions, rope, 16), expected)
    with pytest.raises(ValueError, match="whole groups of 32"):
        triton_window_kv.window_kv(kv, weight, 1e-6, positions, rope.table)


@pytest.mark.parametrize("d,rope_dims", [(512, 64), (64, 16)], ids=["one launch", "three launches"])
def test_rows_made_into_a_buffer_s_head(d, rope_dims):
    """``window_kv(out=)``: the attention makes its KV rows in the head of its pool of rows; the rows are
    the returned ones' bits and nothing past them is written."""
    gen = torch.Generator().manual_seed(d)
    kv = torch.randn(3, d, generator=gen).bfloat16().to(device())
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16().to(device())
    positions = torch.tensor([0, 17, 4000], device=device())
    rope, kernels = rope_table(rope_dims), TritonKernels()
    pool = torch.full((5, d), 7.0, dtype=torch.bfloat16, device=device())
    made = kernels.window_kv(kv, weight, 1e-6, positions, rope, rope_dims, out=pool[:3])
    assert made.data_ptr() == pool.data_ptr()
    assert torch.equal(pool[:3], kernels.window_kv(kv, weight, 1e-6, positions, rope, rope_dims))
    assert bool((pool[3:] == 7.0).all())


@pytest.mark.parametrize("d,rope_dims", [(512, 64), (96, 32), (64, 16)],
                         ids=["one launch", "one launch, 96 dims", "three launches"])
def test_rows_stored_in_the_ring_as_the_codec_stores_them(d, rope_dims, monkeypatch):
    """``window_kv(ring=)``: a decode step's rows go into the window's ring in the launch that makes them
    (apart, where the kernel does not take the rows): the bytes that the codec's own encoding writes for the
    returned rows, at their rows, and no other byte changed. Values across many scales (FP8 subnormals,
    the scale's floor) exercise the encoding."""
    gen = torch.Generator().manual_seed(d + rope_dims)
    scales = torch.logspace(-7, 2, d // 32).repeat_interleave(32)
    kv = (torch.randn(3, d, generator=gen) * scales).bfloat16().to(device())
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16().to(device())
    positions = torch.tensor([0, 17, 4000], device=device())
    rope, kernels = rope_table(rope_dims), TritonKernels()
    rows = torch.tensor([5, 17, 62], device=device())  # of 4 slots x 16 ring rows

    ring = QuantizedRows(RowCodec(WINDOW_KV, d, device()), (4, 16), device())
    ring.fused = True  # the kernels' path (on CPU, in Triton's interpreter)
    ring.data.copy_(torch.randint(0, 256, ring.data.shape, generator=gen, dtype=torch.uint8))
    expected = QuantizedRows(RowCodec(WINDOW_KV, d, "cpu"), (4, 16), "cpu")  # the codec's torch encoding
    expected.fused = False
    expected.data.copy_(ring.data.cpu())
    calls = []  # the rows written apart, after the launch
    real_call = RowsWrite.__call__
    monkeypatch.setattr(RowsWrite, "__call__", lambda self, values: calls.append(1) or real_call(self, values))
    made = kernels.window_kv(kv, weight, 1e-6, positions, rope, rope_dims, ring=RowsWrite(ring, rows))
    assert torch.equal(made, kernels.window_kv(kv, weight, 1e-6, positions, rope, rope_dims))
    expected.write_rows(rows.cpu(), made.cpu())
    assert torch.equal(ring.data.cpu(), expected.data)
    assert len(calls) == (0 if triton_window_kv.takes(d, rope_dims) else 1)  # stored inside the launch, or apart
