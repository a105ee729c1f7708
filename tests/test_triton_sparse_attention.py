"""The sparse-attention kernel (``model/kernels/triton_sparse_attention.py``) against its twin.

Without a GPU these run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``) at small
shapes and at the real head width; ``test_real_shapes_on_gpu`` repeats the comparison at the real
V4.1-Flash shapes on CUDA.

Tolerance. Both sides take the same exact bf16 x bf16 products and round the same way at every
elementwise step; only the order of the fp32 sums differs (inside the two products and in the
64-entry sum of ``p``). That moves a score by a few fp32 ulps, and so ``p_i`` by a relative
~1e-6, which now and then carries its rounding to bf16 across a rounding boundary: ``bf16(p_i)``
then differs by one bf16 ulp, at most ``2**-7 * p_i``. Such a flip moves a head's output by at most
``2**-7 * w_i * |kv_i|`` (``w_i = p_i / sum``, the entry's attention weight), in every feature of the
head, so even if every entry flipped the fp32 outputs would differ by at most ``2**-7 * sum_i w_i
|kv_i[d]|``, and the final rounding to bf16 adds one ulp of the output (at most ``2**-7 * |out|``):

    |kernel - twin| <= 2**-7 * |twin| + 2**-7 * sum_i w_i |kv_i[d]|   (+ 2**-40 for the fp32 noise)

Flips are rare and a flip changes only the features of its own head, so the outputs are bit-equal
but for at most 1% of the elements (or one head's row, in tiny shapes). Measured in the interpreter
(numpy's fp32 sums against torch's): 99.5% to 100% bit-equal, differences under half the bound. A
real bug does not pass both checks: ``test_the_check_rejects_a_wrong_arithmetic`` holds three
mutations of the twin to them (no rescale of the running sums: far beyond the bound; the sink
scaled by ``scale``, or ``p`` not rounded to bf16: bit-equal in at most ~90% of the elements).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.kernels.reference import ReferenceKernels  # noqa: E402
from model.sparse_attention import sparse_attention_padded  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

MIN_BIT_EQUAL = 0.99


def as_pool(q, kv, valid, sink, scale):
    """Per-row lists ``kv [T, L, D]`` as the kernels take them: a pool of rows and each list's indices."""
    t, length, d = kv.shape
    index = torch.arange(t * length, device=kv.device).view(t, length)
    return q, kv.reshape(t * length, d), index, valid, sink, scale


def kernel_output(inputs, **options) -> torch.Tensor:
    """The kernel on ``device()``, its output back on the CPU (where the twin runs)."""
    from model.kernels.triton_sparse_attention import sparse_attention

    return sparse_attention(*(x.to(device()) if isinstance(x, torch.Tensor) else x
                              for x in as_pool(*inputs)), **options).cpu()


def random_inputs(t: int, h: int, d: int, length: int, seed: int, sharp: bool = False, device: str = "cpu"):
    """Random rows with holes at random (30%), a whole block of holes, a leading block of holes in
    row 1 and no valid entry in row 0; sinks large (even heads) and small (odd heads). ``sharp``:
    larger scores, so the softmax is peaked and the running max moves more."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, d, generator=gen) * (4.0 if sharp else 1.0)).bfloat16()
    kv = torch.randn(t, length, d, generator=gen).bfloat16()
    valid = torch.rand(t, length, generator=gen) < 0.7
    if length > 64:
        valid[:, 64:128] = False
    if t > 1:
        valid[1, :64] = False
        valid[0] = False
    sink = torch.where(torch.arange(h) % 2 == 0, 6.0, -8.0) + torch.randn(h, generator=gen)
    return q.to(device), kv.to(device), valid.to(device), sink.to(device), d ** -0.5


def attention_weighted_magnitude(q, kv, valid, sink, scale) -> torch.Tensor:
    """``sum_i w_i |kv_i[d]|`` per (row, head, feature), ``w`` the attention weights (with the sink)."""
    scores = torch.einsum("thd,tld->thl", q.float(), kv.float()) * scale
    scores = torch.where(valid.unsqueeze(1), scores, -torch.inf)
    with_sink = torch.cat([scores, sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    weights = torch.softmax(with_sink, dim=-1)[..., :-1]
    return torch.einsum("thl,tld->thd", weights, kv.float().abs() * valid.unsqueeze(-1))


def mismatch(got, ref, q, kv, valid, sink, scale, min_bit_equal: float = MIN_BIT_EQUAL) -> str | None:
    """Why ``got`` is not the twin's ``ref`` within the tolerance (module docstring); None if it is."""
    got, ref = got.float(), ref.float()
    bound = ref.abs() * 2.0 ** -7 + attention_weighted_magnitude(q, kv, valid, sink, scale) * 2.0 ** -7 + 2.0 ** -40
    worst = ((got - ref).abs() / bound).max().item()
    differing = int((got != ref).sum())
    if worst > 1.0:
        return f"difference {worst:.3g} times the bound"
    if differing > max((1 - min_bit_equal) * got.numel(), got.shape[-1]):
        return f"only {1 - differing / got.numel():.2%} of the elements bit-equal"
    return None


SHAPES = [  # (T, H, D, L)
    (1, 1, 16, 64), (3, 4, 64, 128), (17, 4, 64, 200), (3, 16, 64, 640), (17, 16, 16, 640),
    (17, 64, 16, 200), (3, 64, 16, 640), (1, 64, 512, 640), (3, 16, 512, 128), (1, 4, 512, 200),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}-L{}".format(*s))
@pytest.mark.parametrize("sharp", [False, True], ids=["spread", "sharp"])
def test_matches_reference(shape, sharp):
    inputs = random_inputs(*shape, seed=sum(shape) + sharp, sharp=sharp)
    got = kernel_output(inputs)
    ref = ReferenceKernels(batch_invariant=True).sparse_attention(*as_pool(*inputs))
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert (failure := mismatch(got, ref, *inputs)) is None, failure
    if shape[0] > 1:
        assert torch.equal(got[0], torch.zeros_like(got[0])), "a row without a valid entry must give zeros"


def test_heads_beyond_one_program_and_a_partial_head_block_match_reference():
    """128 heads take two programs per row (64 each); 20 heads one program of 32 rows, 12 of them masked."""
    for shape in ((2, 128, 32, 130), (2, 20, 64, 128)):
        inputs = random_inputs(*shape, seed=shape[1])
        got = kernel_output(inputs)
        ref = ReferenceKernels(batch_invariant=True).sparse_attention(*as_pool(*inputs))
        assert (failure := mismatch(got, ref, *inputs)) is None, (shape, failure)


def _mutated_reference(q, kv, valid, sink, scale, bug: str | None) -> torch.Tensor:
    """The twin's arithmetic written out, with one deliberate bug (None: the twin itself)."""
    t, h, d = q.shape
    pad = -kv.shape[1] % 64
    kv, valid = torch.nn.functional.pad(kv, (0, 0, 0, pad)), torch.nn.functional.pad(valid, (0, pad))
    acc, total, running_max = torch.zeros(t, h, d), torch.zeros(t, h), torch.full((t, h), -1e30)
    for start in range(0, kv.shape[1], 64):
        ok = valid[:, start:start + 64]
        block = kv[:, start:start + 64].float() * ok.unsqueeze(-1)
        scores = torch.where(ok.unsqueeze(1), torch.bmm(q.float(), block.transpose(1, 2)), -torch.inf)
        scores = scores * torch.tensor(scale)
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        rescale = torch.ones_like(new_max) if bug == "no rescale" else torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max.unsqueeze(-1))
        total = total * rescale + p.sum(dim=-1)
        rounded = p if bug == "p not rounded" else p.to(torch.bfloat16).float()
        acc = acc * rescale.unsqueeze(-1) + torch.bmm(rounded, block)
        running_max = new_max
    total = total + torch.exp((sink * scale if bug == "sink scaled" else sink) - running_max)
    return (acc / total.unsqueeze(-1)).to(torch.bfloat16)


@pytest.mark.parametrize("sharp", [False, True], ids=["spread", "sharp"])
def test_the_check_rejects_a_wrong_arithmetic(sharp):
    inputs = random_inputs(3, 16, 64, 640, seed=5, sharp=sharp)
    ref = sparse_attention_padded(*inputs)
    assert torch.equal(_mutated_reference(*inputs, bug=None), ref)
    for bug in ("no rescale", "sink scaled", "p not rounded"):
        assert mismatch(_mutated_reference(*inputs, bug=bug), ref, *inputs) is not None, bug


def rows(inputs, chosen: slice):
    q, kv, valid, sink, scale = inputs
    return q[chosen], kv[chosen], valid[chosen], sink, scale


def test_rows_do_not_depend_on_the_batch():
    inputs = random_inputs(17, 16, 64, 200, seed=8)
    batched = kernel_output(inputs)
    for chosen in (slice(0, 1), slice(1, 2), slice(5, 6), slice(16, 17), slice(3, 10)):
        assert torch.equal(kernel_output(rows(inputs, chosen)), batched[chosen]), chosen


def test_padding_with_holes_changes_no_bit():
    """Hole columns appended across block boundaries, with NaN contents (holes are never read)."""
    q, kv, valid, sink, scale = random_inputs(5, 16, 64, 200, seed=9)
    base = kernel_output((q, kv, valid, sink, scale))
    for extra in (1, 56, 190):
        wide_kv = torch.cat([kv, torch.full((5, extra, 64), float("nan")).bfloat16()], dim=1)
        wide_valid = torch.cat([valid, torch.zeros(5, extra, dtype=torch.bool)], dim=1)
        assert torch.equal(kernel_output((q, wide_kv, wide_valid, sink, scale)), base), f"{extra} holes appended"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_real_shapes_on_gpu(t):
    """V4.1-Flash: 64 heads of 512, lists of 128 window + 512 selected entries; a row alone gives the
    bits it gets in the batch."""
    from model.kernels import triton_sparse_attention as attention
    from model.kernels.triton_sparse_attention import sparse_attention

    inputs = random_inputs(t, 64, 512, 640, seed=t, device="cuda")
    ref = ReferenceKernels(batch_invariant=True).sparse_attention(*as_pool(*inputs))
    got = sparse_attention(*as_pool(*inputs))
    assert (failure := mismatch(got, ref, *inputs)) is None, failure
    for chosen in (slice(0, 1), slice(t - 1, t)):
        alone = sparse_attention(*as_pool(*rows(inputs, chosen)))
        assert torch.equal(alone, got[chosen]), chosen
    few = sparse_attention(*as_pool(*inputs), batch_invariant=False)  # 16 heads per program up to 16 rows
    split = attention.few_rows(t)  # ... and the entries split: p rounded against each split's maximum
    assert (failure := mismatch(few, ref, *inputs, min_bit_equal=0.0 if split else MIN_BIT_EQUAL)) is None, failure


@pytest.mark.parametrize("shape", [(1, 64, 512, 640), (3, 64, 16, 640), (16, 64, 64, 200), (2, 20, 64, 128)],
                         ids=lambda s: "T{}-H{}-D{}-L{}".format(*s))
@pytest.mark.parametrize("sharp", [False, True], ids=["spread", "sharp"])
def test_few_rows_split_their_entries_and_stay_within_the_bound(shape, sharp):
    """Outside the batch-invariant mode up to FEW_ROWS rows spread each row's heads over programs of 16
    and its entries over splits (``split_config``), which ``_combine_splits_kernel`` joins. Each split
    rounds ``p`` to bf16 against its own running maximum, not the twin's: every ``bf16(p_i)`` is still
    within one bf16 ulp of its exact value, so the bound holds (it allows every entry to flip), but many
    more outputs differ from the twin by an ulp (in the interpreter 62-100% bit-equal, differences under
    half the bound)."""
    from model.kernels import triton_sparse_attention as attention

    assert attention.launch_config(shape[1], shape[2], narrow_heads=attention.few_rows(shape[0]))[0] == 16
    programs = shape[0] * -(-shape[1] // 16)
    splits, split_len = attention.split_config(programs, shape[3], 132)
    assert splits > 1 and split_len % attention.BLOCK_L == 0 and (splits - 1) * split_len < shape[3]
    inputs = random_inputs(*shape, seed=sum(shape) + 1, sharp=sharp)
    got = kernel_output(inputs, batch_invariant=False)
    ref = ReferenceKernels(batch_invariant=True).sparse_attention(*as_pool(*inputs))
    assert (failure := mismatch(got, ref, *inputs, min_bit_equal=0.0)) is None, failure
    assert torch.equal(kernel_output(inputs, batch_invariant=False), got)  # splits joined in a fixed order
    if shape[0] > 1:
        assert torch.equal(got[0], torch.zeros_like(got[0])), "a row without a valid entry must give zeros"


def test_the_split_check_rejects_a_wrong_combination(monkeypatch):
    """The bound alone still catches a wrong join of the splits: outputs joined without bringing each
    split to the common maximum are far outside it."""
    from model.kernels import triton_sparse_attention as attention

    inputs = random_inputs(1, 64, 64, 640, seed=7, sharp=True)
    ref = ReferenceKernels(batch_invariant=True).sparse_attention(*as_pool(*inputs))
    real = attention._combine_splits_kernel

    class NoRescale:  # the combination told that every split reached the common maximum: no rescaling
        def __getitem__(self, grid):
            def launch(acc, maxima, *args, **kwargs):
                return real[grid](acc, maxima.amax(dim=1, keepdim=True).expand_as(maxima).contiguous(), *args,
                                  **kwargs)
            return launch

    monkeypatch.setattr(attention, "_combine_splits_kernel", NoRescale())
    got = kernel_output(inputs, batch_invariant=False)
    assert mismatch(got, ref, *inputs, min_bit_equal=0.0) is not None


def test_rows_shared_by_many_lists_are_read_from_one_pool():
    """A prefill chunk's lists overlap: each pool row is listed by many queries, in any order, and a
    list may repeat a row. The kernel reads them in place; the twin on the gathered copies agrees."""
    from model.kernels.triton_sparse_attention import sparse_attention

    gen = torch.Generator().manual_seed(11)
    t, h, d, rows_in_pool, length = 9, 16, 64, 150, 200
    q, _, valid, sink, scale = random_inputs(t, h, d, length, seed=11)
    pool = torch.randn(rows_in_pool, d, generator=gen).bfloat16()
    index = torch.randint(0, rows_in_pool, (t, length), generator=gen)
    index[2, :50] = 7  # one row listed fifty times
    index[~valid] = -1  # a hole's index is never read
    got = sparse_attention(*(x.to(device()) if isinstance(x, torch.Tensor) else x
                             for x in (q, pool, index, valid, sink, scale))).cpu()
    kv_rows = pool[index.clamp(min=0)]
    ref = sparse_attention_padded(q, kv_rows, valid, sink, scale)
    assert (failure := mismatch(got, ref, q, kv_rows, valid, sink, scale)) is None, failure


@pytest.mark.parametrize("shape", [(1, 64, 512, 640, 64, False), (3, 16, 64, 640, 16, False),
                                   (2, 20, 64, 200, 16, False), (17, 4, 64, 200, 16, False),
                                   (3, 64, 64, 200, 16, True)],
                         ids=lambda s: "T{}-H{}-D{}-L{}-R{}{}".format(*s[:5], "-invariant" if s[5] else ""))
def test_the_output_rotated_back_in_the_launches_is_rotate_s_bits(shape, monkeypatch):
    """``sparse_attention_rotated_back``: where a few rows split their entries, the combining launch rotates
    the output back in its registers (each pair in one thread) with ``_rope_kernel``'s arithmetic; elsewhere
    ``rotate_`` runs after the attention. Either way the bits of the attention and ``rotate_`` apart."""
    from model.kernels import triton_sparse_attention as attention
    from model.kernels.backend import KernelBackend
    from model.kernels.triton_backend import TritonKernels
    from model.rope import RotaryTable, rope_frequencies

    t, h, d, length, rope_dims, invariant = shape
    q, kv, valid, sink, scale = random_inputs(t, h, d, length, seed=sum(shape), device=device())
    _, pool, index, *_ = as_pool(q, kv, valid, sink, scale)
    table = RotaryTable(rope_frequencies(rope_dims, 10000.0, 1.0, 0, 32, 1), 9000, device())
    positions = torch.randint(0, 9000, (t,), generator=torch.Generator().manual_seed(t)).to(device())
    backend = TritonKernels(batch_invariant=invariant)
    args = (q, pool, index, valid, sink, scale, positions, table, rope_dims)
    apart = KernelBackend.sparse_attention_rotated_back(backend, *args)
    launches = []
    real = attention.rotate_
    monkeypatch.setattr(attention, "rotate_", lambda *a, **k: launches.append(1) or real(*a, **k))
    fused = backend.sparse_attention_rotated_back(*args)
    assert torch.equal(fused, apart)
    assert not torch.equal(fused, backend.sparse_attention(q, pool, index, valid, sink, scale))  # rotated
    split = not invariant and attention.few_rows(t)  # (every case's list is several blocks long)
    assert launches == ([] if split else [1])
