"""The pair sort of the experts' kernels (``model/kernels/triton_align_pairs.py``) against its torch
version, element for element: both are integer programs, so any difference is a bug.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from model.kernels.triton_align_pairs import MAX_PAIRS, align_pairs, chunk_sizes  # noqa: E402
from model.kernels.triton_moe import align_pairs_torch  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

NAMES = ("sorted_pair", "expert_start", "expert_count", "block_expert", "block_index")


def assert_same_as_torch(ids: torch.Tensor, experts: int, block: int) -> None:
    got = align_pairs(ids.to(device()), experts, block)
    ref = align_pairs_torch(ids, experts, block)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == r.dtype == torch.int64, name
        assert torch.equal(g.cpu(), r), f"{name}: {g.cpu().tolist()} != {r.tolist()}"


@pytest.mark.parametrize("pairs,experts,block", [
    (1, 7, 4), (6, 384, 16), (41, 7, 4), (300, 16, 16), (129, 5, 3), (256, 3, 64),
])
def test_matches_the_torch_version(pairs, experts, block):
    """Several chunks of pairs, experts without pairs, ids outside ``[0, E)`` (other ranks' experts
    and -1), blocks of one pair and blocks wider than any expert's pairs."""
    gen = torch.Generator().manual_seed(pairs + experts)
    ids = torch.randint(-1, experts + 2, (pairs,), generator=gen)
    assert_same_as_torch(ids, experts, block)


def test_chunks_are_as_wide_as_the_step_needs():
    """The cases above run chunks of 16 to 128 pairs and 16 to 64 blocks (one chunk or several)."""
    assert chunk_sizes(1, 1) == (16, 16)
    assert chunk_sizes(6, 7) == (16, 16)  # a one-token step of V4.1-Flash
    assert chunk_sizes(41, 18) == (64, 32)
    assert chunk_sizes(300, 400) == (128, 64)


def test_one_expert_takes_every_pair_and_none_is_local():
    assert_same_as_torch(torch.full((200,), 2), 4, 16)  # pair order kept within one expert
    assert_same_as_torch(torch.full((70,), -1), 4, 16)  # no local pair: every block unused


def test_blocks_cover_every_local_pair_once():
    gen = torch.Generator().manual_seed(5)
    experts, block = 7, 4
    ids = torch.randint(-1, experts + 1, (41,), generator=gen)
    sorted_pair, start, count, block_expert, block_index = (t.cpu() for t in align_pairs(ids.to(device()), experts, block))
    covered = []
    for b, e in enumerate(block_expert.tolist()):
        if e < 0:
            continue
        rows = range(block_index[b] * block, min((block_index[b] + 1) * block, count[e]))
        covered += [sorted_pair[start[e] + r].item() for r in rows]
        assert all(ids[sorted_pair[start[e] + r]] == e for r in rows)
    assert sorted(covered) == [i for i, e in enumerate(ids.tolist()) if 0 <= e < experts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 256, MAX_PAIRS // 6])
def test_real_sizes_on_gpu(tokens):
    """V4.1-Flash: 384 experts, 6 per token; a rank of eight holding 48 of them."""
    gen = torch.Generator().manual_seed(tokens)
    for experts in (384, 48):
        ids = torch.stack([torch.randperm(384, generator=gen)[:6] for _ in range(tokens)]).flatten()
        for block in (16, 64):
            assert_same_as_torch(ids, experts, block)


@pytest.mark.parametrize("pairs,experts", [(6, 384), (41, 7), (300, 16), (70, 4)])
def test_zeroes_the_output_rows_of_pairs_of_no_local_expert(pairs, experts):
    """``zero_rows``: the rows of pairs whose expert is another rank's (or -1) become zeros; the
    others, which the experts' kernels write, are left as they were (over one chunk and several)."""
    gen = torch.Generator().manual_seed(pairs)
    ids = torch.randint(-1, experts + 2, (pairs,), generator=gen)
    if pairs == 70:
        ids[:] = -1  # no local pair at all
    rows = torch.randn(pairs, 72, generator=gen).to(torch.bfloat16)  # D not a whole number of stores
    out = rows.to(device())
    align_pairs(ids.to(device()), experts, 16, zero_rows=out)
    foreign = (ids < 0) | (ids >= experts)
    expected = torch.where(foreign[:, None], torch.zeros_like(rows), rows)
    assert torch.equal(out.cpu(), expected)
    with pytest.raises(ValueError, match="zero_rows"):
        align_pairs(ids.to(device()), experts, 16, zero_rows=out[:, :8])


def test_the_torch_sort_of_large_steps_zeroes_the_whole_output():
    """Above ``MAX_PAIRS`` the experts' sort runs as torch ops; with ``zero_rows`` it zeroes the whole
    output, which the experts' kernels then write in part."""
    from model.kernels.triton_moe import align_pairs as experts_align_pairs
    ids = torch.randint(-1, 9, (MAX_PAIRS + 1,), generator=torch.Generator().manual_seed(1))
    out = torch.ones(MAX_PAIRS + 1, 4, dtype=torch.bfloat16, device=device())
    got = experts_align_pairs(ids.to(device()), 8, 16, zero_rows=out)
    assert torch.equal(got[0].cpu(), align_pairs_torch(ids, 8, 16)[0])
    assert not out.any()
