"""The TMA ring of ``triton_mma_gemv`` (``model/kernels/triton_ring_mma_gemv.py``, a Gluon kernel) on a GPU.

Triton's interpreter runs no Gluon, so this file needs CUDA (Hopper or later: the tensor memory
accelerator); the CPU suite compiles the kernel for sm_90 instead (``test_triton_compile.py``). The
ring changes only how the weight reaches the registers, so its outputs must be ``triton_mma_gemv``'s
own bits at the same config (its split, its steps): that is the check here, next to the reference's
tolerance (``assert_close_to_reference``, as ``test_triton_mma_gemv.py`` derives it).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.config import WeightFormat  # noqa: E402
from model.kernels import tile_configs, triton_split_sums  # noqa: E402
from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.kernels.triton_mma_gemv import fp8_mma_gemv, ring_takes  # noqa: E402
from tests.test_triton_kernels import assert_close_to_reference, random_weight  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a GPU with the tensor memory accelerator (Hopper or later)"),
]

REFERENCE = ReferenceKernels(batch_invariant=False)


def _config(monkeypatch, warps: int, programs_per_sm: int, step_blocks: int, stages: int, max_splits: int = 64):
    cfg = tile_configs.DecodeConfig(32 * warps, 32 * step_blocks, warps, stages, programs_per_sm,
                                    max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_TABLE", ((8, cfg),))
    monkeypatch.setattr(tile_configs, "_MMA_GEMV_BY_SHAPE", {})


def _ring_and_registers(monkeypatch, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The product through the ring, then through ``triton_mma_gemv``'s registers at the same config."""
    monkeypatch.setattr(tile_configs, "MMA_GEMV_RING", True)
    ring = fp8_mma_gemv(*args, **kwargs)
    monkeypatch.setattr(tile_configs, "MMA_GEMV_RING", False)
    registers = fp8_mma_gemv(*args, **kwargs)
    monkeypatch.setattr(tile_configs, "MMA_GEMV_RING", True)
    return ring, registers


@pytest.mark.parametrize("m,n,k,warps,programs_per_sm,max_splits,step_blocks,stages", [
    (1, 64, 256, 2, 1, 64, 1, 2),  # one split: the bf16 output stored by the lanes themselves
    (3, 96, 320, 2, 64, 64, 1, 3),  # every block a split; the second program's second warp past the last row
    (3, 128, 384, 4, 64, 5, 1, 4),  # splits of 3 blocks, a ring deeper than a split's steps
    (8, 160, 256, 1, 4, 3, 1, 2),  # every token column in use, one warp per program, splits of 3, 3 and 2
    (5, 32, 96, 1, 1, 64, 1, 2),  # three blocks, one warp, one split: the ring goes round once and a half
    (4, 64, 1024, 2, 1, 64, 2, 3),  # two blocks per step: 16 steps round a ring of 3
    (2, 96, 640, 1, 64, 3, 2, 2),  # two blocks per step, splits of 4, 4 and 2 steps
    (7, 64, 512, 2, 1, 64, 4, 2),  # four blocks per step: 4 steps in one split
    (6, 96, 1536, 1, 64, 3, 4, 4),  # four blocks per step, splits of 4, 4 and 4 steps
    (8, 256, 2048, 8, 1, 64, 4, 3),  # eight warps: boxes of 256 rows
])
def test_ring_gives_the_registers_bits(monkeypatch, m, n, k, warps, programs_per_sm, max_splits, step_blocks,
                                       stages):
    _config(monkeypatch, warps, programs_per_sm, step_blocks, stages, max_splits)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = random_weight(WeightFormat.FP8, n, k, gen)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-6, 6, m, base=2.0)[:, None]).bfloat16()
    ref = REFERENCE.quantized_linear(x, weight)
    on = weight.to("cuda")
    assert ring_takes(on.values)
    ring, registers = _ring_and_registers(monkeypatch, x.cuda(), [(on.values, on.scales)], quantize=True)
    assert torch.equal(ring, registers)
    assert_close_to_reference(ring.cpu(), ref)
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


@pytest.mark.parametrize("pdl", [False, True])
def test_two_weights_and_groups_at_real_shapes(monkeypatch, pdl):
    """Two weights in one launch (1536 and 512 rows of K = 4096) and the grouped form of ``wo_a`` (8 groups),
    through the ring with and without programmatic dependent launch."""
    _config(monkeypatch, 4, 2, 4, 3)
    gen = torch.Generator().manual_seed(17 + pdl)
    first, second = random_weight(WeightFormat.FP8, 1536, 4096, gen), random_weight(WeightFormat.FP8, 512, 4096, gen)
    grouped = random_weight(WeightFormat.FP8, 8 * 1024, 512, gen)
    x = torch.randn(8, 4096, generator=gen).bfloat16()
    refs = [REFERENCE.quantized_linear(x, w) for w in (first, second)]
    xg = (torch.randn(8, 8, 512, generator=gen) * 1e3).bfloat16()
    ref_grouped = REFERENCE.grouped_dequantized_linear(xg, grouped)
    first, second, grouped = first.to("cuda"), second.to("cuda"), grouped.to("cuda")
    ring, registers = _ring_and_registers(monkeypatch, x.cuda(), [(first.values, first.scales),
                                                                  (second.values, second.scales)],
                                          quantize=True, pdl=pdl)
    assert torch.equal(ring, registers)
    assert_close_to_reference(ring[:, :1536].cpu(), refs[0])
    assert_close_to_reference(ring[:, 1536:].cpu(), refs[1])
    ring, registers = _ring_and_registers(monkeypatch, xg.reshape(8, -1).cuda(), [(grouped.values, grouped.scales)],
                                          quantize=False, groups=8, pdl=pdl)
    assert torch.equal(ring, registers)
    assert_close_to_reference(ring.view(8, 8, 1024).cpu(), ref_grouped)


def test_the_tables_rings_reach_the_backend(monkeypatch):
    """With the tables as they are and 3-8 tokens on ``triton_mma_gemv`` (``--tensor-core-tokens 8``), the
    backend's products whose config has a ring go through it; a weight that starts off a 16-byte boundary
    keeps the registers (TMA's rule)."""
    from model.kernels.triton_backend import TritonKernels

    monkeypatch.setattr(tile_configs, "MMA_GEMV_MAX_TOKENS", 8)
    launched = []
    import model.kernels.triton_ring_mma_gemv as ring_module
    real = ring_module.launch_ring
    monkeypatch.setattr(ring_module, "launch_ring", lambda *a, **kw: launched.append(a[7]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    weight = random_weight(WeightFormat.FP8, 4608, 5120, gen).to("cuda")  # the shared w1 with w3's rows
    x = torch.randn(4, 5120, generator=gen).bfloat16().cuda()
    kernels = TritonKernels()
    got = kernels.quantized_linear(x, weight)
    expect_ring = tile_configs.mma_gemv_config(4, 4608, 5120).num_stages > 1
    assert launched == ([4] if expect_ring else [])
    buffer = torch.empty(4608 * 5120 + 8, dtype=torch.uint8, device="cuda")
    shifted = buffer[8:].view(4608, 5120)  # 8-byte aligned, not 16
    shifted.copy_(weight.values.view(torch.uint8))
    unaligned = type(weight)(shifted.view(weight.values.dtype), weight.scales, weight.fmt)
    assert not ring_takes(unaligned.values)
    launched.clear()
    assert torch.equal(kernels.quantized_linear(x, unaligned), got)  # the same bits through the registers
    assert launched == []
