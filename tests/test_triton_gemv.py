"""The one- and two-token FP8 products on the CUDA cores (``model/kernels/triton_gemv.py``) against the
reference arithmetic, in Triton's interpreter at tiny shapes (on CUDA: the same shapes on the GPU;
``test_triton_kernels_gpu.py`` runs the real ones through the backend).

Tolerance: ``assert_close_to_reference`` (one bf16 ulp of the value plus 2**-16 of the row's largest
output), as for every product whose fp32 sums run in another order than the reference's: the kernel
sums a thread's exact products over all of K, the reference block by block (``test_triton_kernels.py``'s
docstring derives the bound).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from model.config import WeightFormat  # noqa: E402
from model.kernels import tile_configs, triton_gemv, triton_split_sums  # noqa: E402
from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.kernels.triton_common import INTERPRETED  # noqa: E402
from model.kernels.triton_gemv import fp8_gemv  # noqa: E402
from model.kernels.triton_weight_tiles import e4m3_words_to_f32  # noqa: E402
from tests.kernel_checks import device  # noqa: E402
from tests.test_triton_kernels import assert_close_to_reference, random_weight  # noqa: E402

REFERENCE = ReferenceKernels(batch_invariant=False)


def _config(monkeypatch, block_w: int, block_k: int, programs_per_sm: int, max_splits: int = 64,
            sms: int = 132, stages: int = 1) -> None:
    cfg = tile_configs.DecodeConfig(block_w, block_k, 4, stages, programs_per_sm, max_splits=max_splits)
    monkeypatch.setattr(tile_configs, "_GEMV_TABLE", ((triton_gemv.MAX_TOKENS, cfg),))
    monkeypatch.setattr(triton_gemv, "sm_count", lambda device: sms)


@pytest.mark.parametrize("block_w,block_k,programs_per_sm,max_splits,sms,k", [
    (16, 256, 1, 64, 132, 384),  # one split, one item per program: the bf16 output stored directly
    (8, 128, 64, 64, 132, 384),  # every K step a split: fp32 partials added in split order
    (32, 512, 1, 64, 132, 384),  # a step wider than K: halved until it divides K
    (8, 128, 64, 3, 132, 640),  # 5 steps in splits of 2: the last split one step long
    (8, 128, 4, 2, 1, 640),  # 2 splits of 3 and 2 steps (few SMs)
])
def test_one_weight_matches_reference(monkeypatch, block_w, block_k, programs_per_sm, max_splits, sms, k):
    _config(monkeypatch, block_w, block_k, programs_per_sm, max_splits, sms)
    gen = torch.Generator().manual_seed(block_w + block_k + k)
    weight = random_weight(WeightFormat.FP8, 96, k, gen)
    x = (torch.randn(1, k, generator=gen) * 3).bfloat16()
    ref = REFERENCE.quantized_linear(x, weight)
    on = weight.to(device())
    got = fp8_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu()
    assert_close_to_reference(got, ref)
    assert torch.equal(fp8_gemv(x.to(device()), [(on.values, on.scales)], quantize=True).cpu(), got)  # deterministic
    # the last split of each tile added the partials and set its counter back to zero
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


@pytest.mark.parametrize("programs_per_sm", [1, 64])
def test_two_weights_in_one_launch_match_each_alone(monkeypatch, programs_per_sm):
    _config(monkeypatch, 16, 128, programs_per_sm)
    gen = torch.Generator().manual_seed(programs_per_sm)
    first, second = random_weight(WeightFormat.FP8, 64, 256, gen), random_weight(WeightFormat.FP8, 160, 256, gen)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    refs = [REFERENCE.quantized_linear(x, w) for w in (first, second)]
    first, second = first.to(device()), second.to(device())
    both = fp8_gemv(x.to(device()), [(first.values, first.scales), (second.values, second.scales)], quantize=True)
    assert both.shape == (1, 64 + 160)
    assert_close_to_reference(both[:, :64].cpu(), refs[0])
    assert_close_to_reference(both[:, 64:].cpu(), refs[1])
    alone = fp8_gemv(x.to(device()), [(second.values, second.scales)], quantize=True)
    if programs_per_sm == 1:  # the same split alone and together: the same bits
        assert torch.equal(both[:, 64:], alone)


def test_grouped_unquantized_matches_reference(monkeypatch):
    _config(monkeypatch, 8, 128, 16)
    gen = torch.Generator().manual_seed(3)
    weight = random_weight(WeightFormat.FP8, 3 * 64, 256, gen)
    x = torch.randn(1, 3, 256, generator=gen).bfloat16()
    ref = REFERENCE.grouped_dequantized_linear(x, weight)
    on = weight.to(device())
    got = fp8_gemv(x.reshape(1, -1).to(device()), [(on.values, on.scales)], quantize=False, groups=3)
    assert_close_to_reference(got.view(1, 3, 64).cpu(), ref)


def test_a_launch_takes_the_config_of_its_shape(monkeypatch):
    """``tile_configs._GEMV_BY_SHAPE`` is keyed by a launch's output rows (a grouped weight's groups x N,
    plus a second weight's N) and its K; a launch of any other shape takes the table's config."""
    _config(monkeypatch, 16, 128, 1)
    shaped = tile_configs.DecodeConfig(8, 64, 4, 1, 64)
    monkeypatch.setattr(tile_configs, "_GEMV_BY_SHAPE", {(64 + 96, 256): ((1, shaped),), (3 * 64, 256): ((1, shaped),)})
    used = []
    real = triton_gemv.split_count
    monkeypatch.setattr(triton_gemv, "split_count", lambda cfg, *args: used.append(cfg) or real(cfg, *args))
    gen = torch.Generator().manual_seed(11)
    first, second = random_weight(WeightFormat.FP8, 64, 256, gen), random_weight(WeightFormat.FP8, 96, 256, gen)
    grouped = random_weight(WeightFormat.FP8, 3 * 64, 256, gen)
    x, xg = torch.randn(1, 256, generator=gen).bfloat16(), torch.randn(1, 3, 256, generator=gen).bfloat16()
    refs = [REFERENCE.quantized_linear(x, first), REFERENCE.quantized_linear(x, second),
            REFERENCE.grouped_dequantized_linear(xg, grouped)]
    on_first, on_second, on_grouped = first.to(device()), second.to(device()), grouped.to(device())
    both = fp8_gemv(x.to(device()), [(on_first.values, on_first.scales), (on_second.values, on_second.scales)],
                    quantize=True)
    alone = fp8_gemv(x.to(device()), [(on_first.values, on_first.scales)], quantize=True)
    groups = fp8_gemv(xg.reshape(1, -1).to(device()), [(on_grouped.values, on_grouped.scales)], quantize=False,
                      groups=3)
    assert [cfg.block_w for cfg in used] == [8, 16, 8]
    assert_close_to_reference(both[:, :64].cpu(), refs[0])
    assert_close_to_reference(both[:, 64:].cpu(), refs[1])
    assert_close_to_reference(alone.cpu(), refs[0])
    assert_close_to_reference(groups.view(1, 3, 64).cpu(), refs[2])


def test_backend_runs_two_projections_of_one_token_together(monkeypatch):
    """``quantized_linears`` at one and two tokens: one launch for both, the same values as one by one; at
    nine tokens (one launch of the decode form) and in the batch-invariant mode, no matrix-vector launch
    and again the one-by-one products' values."""
    from model.kernels.triton_backend import TritonKernels

    _config(monkeypatch, 16, 128, 1)
    gen = torch.Generator().manual_seed(5)
    weights = [random_weight(WeightFormat.FP8, n, 256, gen).to(device()) for n in (64, 96)]
    x = torch.randn(9, 256, generator=gen).bfloat16().to(device())
    launches = []
    real = triton_gemv.fp8_gemv
    monkeypatch.setattr(triton_gemv, "fp8_gemv", lambda *a, **kw: launches.append(len(a[1])) or real(*a, **kw))
    for kernels in (TritonKernels(), TritonKernels(batch_invariant=True)):
        for rows in (x[:1], x[:2], x):
            launches.clear()
            together = kernels.quantized_linears(rows, weights)
            one_by_one = [kernels.quantized_linear(rows, w) for w in weights]
            vector_form = rows.shape[0] <= triton_gemv.MAX_TOKENS and not kernels.batch_invariant
            assert launches == ([2, 1, 1] if vector_form else []), launches
            for got, alone in zip(together, one_by_one):  # K's two steps split in two, together or alone
                assert got.shape == alone.shape and torch.equal(got, alone)


def test_backend_sends_two_tokens_to_the_vector_kernel(monkeypatch):
    """Two tokens' FP8 products take ``triton_gemv`` (two projections of them in one launch, the grouped
    ``wo_a`` too), each row with its one-token bits."""
    from model.kernels.triton_backend import TritonKernels

    _config(monkeypatch, 16, 128, 1)
    gen = torch.Generator().manual_seed(8)
    weights = [random_weight(WeightFormat.FP8, n, 256, gen).to(device()) for n in (64, 96)]
    grouped = random_weight(WeightFormat.FP8, 3 * 64, 256, gen).to(device())
    x = torch.randn(2, 256, generator=gen).bfloat16().to(device())
    xg = torch.randn(2, 3, 256, generator=gen).bfloat16().to(device())
    launches = []
    real = triton_gemv.fp8_gemv
    monkeypatch.setattr(triton_gemv, "fp8_gemv", lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    kernels = TritonKernels()
    together = kernels.quantized_linears(x, weights)
    groups = kernels.grouped_dequantized_linear(xg, grouped)
    assert launches == [2, 2]
    for row in range(2):
        alone = kernels.quantized_linears(x[row:row + 1], weights)
        assert all(torch.equal(got[row:row + 1], one) for got, one in zip(together, alone))
        assert torch.equal(groups[row:row + 1], kernels.grouped_dequantized_linear(xg[row:row + 1], grouped))


@pytest.mark.parametrize("case", ["one weight in splits", "two weights", "groups", "unaligned start"])
def test_the_ring_in_shared_memory_gives_the_registers_bits(monkeypatch, case):
    """A config of more than one stage streams the weight through a ring of tiles in shared memory
    (the tensor memory accelerator); the arithmetic and its order are the registers' loop's, so the
    bits are the same. A weight whose start is not 16-byte aligned cannot be streamed that way and
    takes the registers' loop at ``tile_configs.GEMV_IN_REGISTERS`` (here the same config as the
    registers' run, so the same bits too)."""
    gen = torch.Generator().manual_seed(len(case))
    groups = 3 if case == "groups" else 1
    k = 640
    shapes = {"two weights": (64, 160), "groups": (3 * 64,)}.get(case, (96,))
    weights = [random_weight(WeightFormat.FP8, n, k, gen).to(device()) for n in shapes]
    pairs = [(w.values, w.scales) for w in weights]
    if case == "unaligned start":  # the same bytes, 8 bytes into a buffer
        buffer = torch.empty(pairs[0][0].numel() + 8, dtype=torch.uint8, device=device())
        moved = buffer[8:].view(pairs[0][0].shape)
        moved.copy_(pairs[0][0].view(torch.uint8))
        pairs = [(moved.view(pairs[0][0].dtype), pairs[0][1])]
        assert not triton_gemv._ring_fits(pairs[0][0])
        monkeypatch.setattr(triton_gemv, "GEMV_IN_REGISTERS", tile_configs.DecodeConfig(16, 128, 4, 1, 4, max_splits=3))
    x = torch.randn(1, groups * k, generator=gen).bfloat16().to(device())
    quantize = case != "groups"
    outputs = []
    for stages in (1, 3):
        _config(monkeypatch, 16, 128, 4, max_splits=3, stages=stages)  # 5 steps in splits of 2, 2 and 1
        outputs.append(fp8_gemv(x, pairs, quantize=quantize, groups=groups))
    assert torch.equal(outputs[0], outputs[1])
    if case == "one weight in splits":
        assert_close_to_reference(outputs[1].cpu(), REFERENCE.quantized_linear(x.cpu(), weights[0].to("cpu")))


@pytest.mark.parametrize("case", ["one weight in splits", "two weights", "groups", "ring"])
def test_more_tokens_give_each_token_its_one_token_bits(monkeypatch, case):
    """Rows in one launch (as many as it takes): each weight value is expanded once and multiplied by
    every row, each row keeping its own sums in the one-token order, so every row has the bits it has
    alone (and so meets the reference's bound), with K in splits or not, two weights, groups, the ring or
    registers."""
    tokens = triton_gemv.MAX_TOKENS
    gen = torch.Generator().manual_seed(20 + len(case))
    groups = 3 if case == "groups" else 1
    k = 640
    shapes = {"two weights": (64, 160), "groups": (3 * 64,)}.get(case, (96,))
    weights = [random_weight(WeightFormat.FP8, n, k, gen).to(device()) for n in shapes]
    pairs = [(w.values, w.scales) for w in weights]
    _config(monkeypatch, 16, 128, 4 if case != "two weights" else 1, max_splits=3, stages=3 if case == "ring" else 1)
    x = (torch.randn(tokens, groups * k, generator=gen) * 3).bfloat16().to(device())
    quantize = case != "groups"
    every = fp8_gemv(x, pairs, quantize=quantize, groups=groups)
    assert every.shape == (tokens, sum(shapes))
    for row in range(tokens):
        assert torch.equal(every[row:row + 1], fp8_gemv(x[row:row + 1], pairs, quantize=quantize, groups=groups))
    if quantize:
        assert_close_to_reference(every[:, :shapes[0]].cpu(), REFERENCE.quantized_linear(x.cpu(), weights[0].to("cpu")))
    else:
        ref = REFERENCE.grouped_dequantized_linear(x.view(tokens, groups, k).cpu(), weights[0].to("cpu"))
        assert_close_to_reference(every.view(tokens, groups, 64).cpu(), ref)
    assert not any(counters.any() for counters in triton_split_sums._counters.values())


def test_rejects_what_it_does_not_compute():
    gen = torch.Generator().manual_seed(0)
    w = random_weight(WeightFormat.FP8, 64, 128, gen).to(device())
    with pytest.raises(ValueError, match="1-2 rows"):
        fp8_gemv(torch.zeros(3, 128, dtype=torch.bfloat16, device=device()), [(w.values, w.scales)], quantize=True)
    with pytest.raises(ValueError, match="K = 96"):
        fp8_gemv(torch.zeros(1, 96, dtype=torch.bfloat16, device=device()), [(w.values, w.scales)], quantize=True)


@triton.jit
def _expand_words(words_ptr, out_ptr, WORDS: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.arange(0, 4)[:, None]
    words = tl.load(words_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * WORDS + tl.arange(0, WORDS)[None, :])
    b0, b1, b2, b3 = e4m3_words_to_f32(words, INTERPRETED)
    values = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (4, 4 * WORDS))  # join adds the last axis
    tl.store(out_ptr + rows * (4 * WORDS) + tl.arange(0, 4 * WORDS)[None, :], values)


def test_e4m3_words_expand_to_every_value_exactly():
    """``e4m3_words_to_f32`` (inline PTX on the GPU, tensor operations in the interpreter): each of the
    254 finite e4m3 bytes, subnormals and -0.0 included, at each of a word's four byte positions, gives
    torch's value of that byte, bit for bit and in memory order."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0x00, 0x80], dtype=torch.uint8)  # 256
    rows = torch.stack([finite.roll(shift) for shift in (0, 1, 2, 3)])  # every byte at every position
    out = torch.empty(4, 256, dtype=torch.float32, device=device())
    _expand_words[(1,)](rows.to(device()), out, WORDS=64, INTERPRETED=INTERPRETED)
    expected = rows.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))
