"""Work beside the caller's stream (``model/kernels/side_stream.py``): mHC's coefficients, the shared
expert, the compressors and Engram's lookups on a second CUDA stream change no bit of the model's output
(the tiny model has two compressors and two Engram layers), and count their splits apart."""

from __future__ import annotations

import pytest
import torch

from model.kernels import side_stream, tile_configs
from model.kernels.reference import ReferenceKernels

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[3 + (i * 11 + j * 5) % 500 for j in range(n)] for i, n in enumerate((5, 12, 33, 70))]


def test_without_a_side_stream_the_work_runs_at_once_and_its_result_is_its_value():
    ran = []
    x = torch.ones(3)
    deferred = ReferenceKernels(batch_invariant=False).beside(x, lambda: ran.append(1) or x * 2)
    assert ran == [1]  # before result() is asked for
    assert torch.equal(deferred.result(), x * 2)
    assert side_stream.lane() == 0


def _outputs(model, device) -> list[torch.Tensor]:
    """Each prompt's prefill, then two decode steps of all four sequences: the hidden states."""
    from model.batch import ForwardBatch
    from model.cache import V41Cache

    block, blocks_each = 16, 8
    cache = V41Cache.allocate(model.cfg, 1 + len(PROMPTS) * blocks_each, len(PROMPTS), block, device)
    tables = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(len(PROMPTS))]
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append(model.forward(ForwardBatch.build([prompt], [0], [i], [tables[i]], device=device), cache).clone())
    for step in range(2):
        rows = [[40 + step + i] for i in range(len(PROMPTS))]
        starts = [len(p) + step for p in PROMPTS]
        batch = ForwardBatch.build(rows, starts, list(range(len(PROMPTS))), tables, device=device)
        out.append(model.forward(batch, cache).clone())
    return out


@pytest.mark.gpu
@needs_cuda
def test_split_counters_of_work_beside_the_caller_are_its_own():
    from model.kernels.triton_backend import TritonKernels
    from model.kernels.triton_split_sums import split_counters

    device = torch.device("cuda")
    x = torch.zeros(4, 8, device=device)
    caller = split_counters(device, 1)
    beside = TritonKernels().beside(x, lambda: (side_stream.lane(), split_counters(device, 1))).result()
    assert beside[0] == 1 and beside[1].data_ptr() != caller.data_ptr()
    assert side_stream.lane() == 0 and split_counters(device, 1) is caller


@pytest.mark.gpu
@needs_cuda
def test_the_model_gives_the_same_bits_with_and_without_the_side_stream(tiny_checkpoint, monkeypatch):
    """Prefills and decode steps of the tiny model through ``--kernels triton``, eagerly, with the work
    beside the caller on a second stream and with everything on one stream: the same hidden states."""
    from model.loader import load_model
    from model.transformer import ModelOptions

    device = torch.device("cuda")
    model = load_model(tiny_checkpoint, ModelOptions(batch_invariant=False, kernels="triton"), device)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(tile_configs, "SIDE_STREAM", on)
        results[on] = _outputs(model, device)
        torch.cuda.synchronize()
    for i, (one, two) in enumerate(zip(results[False], results[True])):
        assert torch.equal(one, two), f"forward {i}"
