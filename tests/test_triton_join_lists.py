"""The list-joining kernel (``model/kernels/triton_join_lists.py``) against its twin
(``model.attention_lists.joined_lists``): integer work, so equal bit for bit. Without a GPU it runs
in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.attention_lists import joined_lists  # noqa: E402
from tests.kernel_checks import device  # noqa: E402


def list_parts(t: int, w: int, k: int, seed: int, reference_layout: bool):
    """Random parts as the attention builds them: window lists valid first (packed) or with holes
    anywhere (the reference's ring order), any widths and counts, pool indices anywhere."""
    gen = torch.Generator().manual_seed(seed)
    window_widths = torch.randint(0, w + 1, (t,), generator=gen)
    if reference_layout:
        window_valid = torch.rand(t, w, generator=gen) < 0.6
    else:
        window_valid = torch.arange(w) < window_widths.unsqueeze(-1)
    window_index = torch.randint(0, 10_000, (t, w), generator=gen)
    compressed_index = torch.randint(0, 10_000, (t, k), generator=gen)
    counts = torch.randint(0, k + 1, (t,), generator=gen)
    widths = torch.minimum(counts + torch.randint(0, 3, (t,), generator=gen), torch.tensor(k)) if reference_layout \
        else counts
    return window_index, window_valid, window_widths, compressed_index, counts, widths


@pytest.mark.parametrize("t,w,k", [(1, 128, 512), (7, 128, 32), (64, 8, 5), (3, 300, 1), (0, 8, 4)])
@pytest.mark.parametrize("reference_layout", [False, True], ids=["packed", "reference"])
def test_join_is_the_twin_bit_for_bit(t, w, k, reference_layout):
    from model.kernels.triton_join_lists import join_lists

    parts = list_parts(t, w, k, seed=t + w + k, reference_layout=reference_layout)
    got = join_lists(*(x.to(device()) for x in parts))
    ref = joined_lists(*parts)
    for name, g, r in zip(("index", "valid", "lengths"), got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert torch.equal(g.cpu(), r), name


def test_the_compressed_part_follows_the_listed_window_columns():
    """A worked row: 2 of 4 window columns listed, then 2 of 3 compressed entries valid."""
    parts = (torch.tensor([[10, 11, 12, 13]]), torch.tensor([[True, True, False, False]]), torch.tensor([2]),
             torch.tensor([[20, 21, 22]]), torch.tensor([2]), torch.tensor([2]))
    from model.kernels.triton_join_lists import join_lists

    index, valid, lengths = (x.cpu() for x in join_lists(*(x.to(device()) for x in parts)))
    assert index[0, :4].tolist() == [10, 11, 20, 21] and valid[0].tolist() == [True] * 4 + [False] * 3
    assert lengths.tolist() == [4]
