"""The indexer's top-k kernel (``model/kernels/triton_top_entries.py``) against its twin, the two
stable sorts of ``model.indexer.top_entries``.

Integer arithmetic on the scores' bits, so the entries must be equal, not close. The scores are
drawn from a few levels so that many rows have ties across their k-th score (the tie rule, lower
entry first, decides them: ``test_the_inputs_tie_at_the_threshold`` checks that they do), with
``-inf`` holes, both zeros (which compare equal) and widths longer than one step of the kernel.
Without a GPU the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.indexer import top_entries as twin  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def random_scores(rows: int, width: int, levels: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.randint(-levels, levels + 1, (rows, width), generator=gen).float() / 8).bfloat16()
    scores[0, : width // 3] = float("-inf")  # entries a query cannot see
    scores[-1, 1::3] = -0.0
    return scores


def random_k(rows: int, k_max: int, seed: int) -> torch.Tensor:
    k = torch.randint(0, k_max + 1, (rows,), generator=torch.Generator().manual_seed(seed))
    k[0], k[-1] = k_max, 0
    return k


def kernel(scores, k, k_max):
    from model.kernels.triton_top_entries import top_entries

    return top_entries(scores.to(device()), k.to(device()), k_max).cpu()


# rows, width, k_max, levels: rows held in registers (up to MAX_TILE entries) and rows re-read in
# steps of MAX_BLOCK (the last two cases); widths that are not a multiple of 8 (300, 8190, 16380,
# 17003) start most rows inside a 16-byte chunk, which the kernel's loads begin before; most widths
# take a tail tile after a power of two (40 = 32 + 16, 300 = 256 + 64, 9,000 = 8,192 + 1,024); 140
# rows are more than an H200's SMs (the launch caps the registers)
CASES = [(6, 40, 16, 3), (9, 300, 64, 40), (5, 5000, 512, 6), (3, 9000, 512, 3000), (4, 8190, 512, 200),
         (140, 72, 16, 5), (3, 16380, 512, 3000), (2, 17003, 512, 3000)]


@pytest.mark.parametrize("rows,width,k_max,levels", CASES)
def test_equals_the_twin(rows, width, k_max, levels):
    scores, k = random_scores(rows, width, levels, seed=width), random_k(rows, k_max, seed=width)
    assert torch.equal(kernel(scores, k, k_max), twin(scores, k, k_max))


def test_the_inputs_tie_at_the_threshold():
    """The cases exercise the tie rule: in most rows the k-th score also occurs outside the top k."""
    for rows, width, k_max, levels in CASES[:3]:
        scores, k = random_scores(rows, width, levels, seed=width), random_k(rows, k_max, seed=width)
        tied = 0
        for row in range(rows):
            if k[row] == 0:
                continue
            ranked = torch.sort(scores[row].float(), descending=True, stable=True).values
            tied += int(k[row] < width and ranked[k[row] - 1] == ranked[k[row]])
        assert tied >= (rows - 1) // 2, (width, tied)


def test_rows_do_not_depend_on_the_batch():
    scores, k = random_scores(9, 300, 40, seed=1), random_k(9, 64, seed=1)
    batched = kernel(scores, k, 64)
    for row in (0, 4, 8):
        assert torch.equal(kernel(scores[row:row + 1], k[row:row + 1], 64), batched[row:row + 1])


def test_strided_scores_and_empty_inputs():
    scores, k = random_scores(4, 100, 5, seed=2), random_k(4, 32, seed=2)
    wide = torch.cat([scores, scores], dim=1)[:, :100]
    assert torch.equal(kernel(wide, k, 32), twin(scores, k, 32))
    inside_a_chunk = torch.cat([scores[:, :3], scores], dim=1)[:, 3:]  # the first row 6 bytes past a boundary
    assert torch.equal(kernel(inside_a_chunk, k, 32), twin(scores, k, 32))
    assert kernel(scores[:0], k[:0], 32).shape == (0, 32)
    assert kernel(scores, k * 0, 0).shape == (4, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,width", [(1, 4096), (1, 8192), (3, 8216), (64, 8192), (8192, 8192), (1, 16384),
                                        (5, 16390), (4, 32768)])
def test_equals_the_twin_on_cuda_at_real_sizes(rows, width):
    """Decode rows over an 8K context's entries at ratios 2 and 1 (8,216: a bucket just above 8K), an
    8K prefill's rows at ratio 1, a 16K context (the longest row held in registers; 16,390 entries
    starting inside a 16-byte chunk are re-read), a 32K context (rows re-read)."""
    scores = random_scores(rows, width, 200, seed=rows).cuda()
    k = torch.randint(0, 513, (rows,), device="cuda")
    from model.kernels.triton_top_entries import top_entries

    assert torch.equal(top_entries(scores, k, 512), twin(scores, k, 512))
