"""``benchmarks/read_chain.py``: the read kernel reads every word once (in the interpreter), and the
launches stand for the layer's one-token products byte for byte."""

import os

import pytest
import torch

from benchmarks.kernel_inputs import FLASH, linear_specs


def test_launches_read_the_layer_products_bytes():
    from benchmarks.read_chain import launch_bytes

    launches = launch_bytes()
    assert [name for name, _ in launches] == ["attn.wq_a + attn.wkv", "attn.wq_b + indexer.wq_b",
                                              "attn.wo_a (grouped)", "attn.wo_b", "shared.w1 + shared.w3",
                                              "shared.w2"]
    values = sum(s.groups * s.n * s.k for s in linear_specs(FLASH))
    assert sum(nbytes for _, nbytes in launches) == values + values // 1024  # one scale byte per 32 x 32


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter or CUDA")
@pytest.mark.parametrize("words, programs", [(5000, 3), (2048, 4), (7, 2)])
def test_read_kernel_sums_every_word_once(words, programs):
    from benchmarks.read_chain import ReadChain

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chain = ReadChain(device, programs, stages=2)
    chain.out.zero_()
    src = torch.arange(words, dtype=torch.int32, device=device)
    chain.read(src)
    assert int(chain.out.sum()) == words * (words - 1) // 2
