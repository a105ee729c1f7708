"""A sub-layer's input in one launch (``model/kernels/triton_sublayer_input.py``) against the two launches it
replaces (``triton_mhc.collapse``, then ``triton_rms_norm.rms_norm``), each of which its own test holds
against its twin.

Without a GPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``). The one
launch does each step's arithmetic in its order and rounds where the launches store, so the check is bit
for bit.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model.kernels import triton_mhc, triton_rms_norm, triton_sublayer_input  # noqa: E402
from model.kernels.triton_backend import TritonKernels  # noqa: E402
from tests.kernel_checks import device  # noqa: E402

EPS = 1e-6


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def stream_inputs(t: int, hc: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    stream = (torch.randn(t, hc, d, generator=gen) * torch.rand(t, 1, 1, generator=gen) * 8).bfloat16()
    pre = torch.rand(t, hc, generator=gen) * 2 - 0.5  # negative weights too: -0.0 and cancellations
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    return stream.to(device()), pre.to(device()), weight.to(device())


@pytest.mark.parametrize("t,hc,d,outputs", [(1, 4, 5120, triton_rms_norm.BOTH), (1, 4, 5120, triton_rms_norm.PLAIN),
                                             (7, 4, 256, triton_rms_norm.BOTH), (3, 2, 96, triton_rms_norm.BOTH),
                                             (20, 4, 1000, triton_rms_norm.PLAIN)])  # (the round trip: D % 32 == 0)
def test_one_launch_gives_the_two_launches_bits(t, hc, d, outputs):
    stream, pre, weight = stream_inputs(t, hc, d, seed=t + hc + d)
    two = triton_rms_norm.rms_norm(triton_mhc.collapse(stream, pre), weight, EPS, outputs=outputs)
    one = triton_sublayer_input.sublayer_input(stream, pre, weight, EPS, outputs=outputs)
    for got, want in zip(one if outputs == triton_rms_norm.BOTH else (one,),
                         two if outputs == triton_rms_norm.BOTH else (two,), strict=True):
        assert same_bits(got, want)


def test_a_strided_stream_and_the_batch():
    """A stream viewed out of a wider tensor (rows and copies at strides of their own) gives the bits of its
    contiguous copy, and each row's result does not depend on the rows beside it."""
    wide, pre, weight = stream_inputs(9, 4, 640, seed=5)
    stream = wide[:, :, :512]  # rows 2,560 apart, copies 640 apart
    got = triton_sublayer_input.sublayer_input(stream, pre, weight[:512], EPS)
    assert same_bits(got, triton_sublayer_input.sublayer_input(stream.contiguous(), pre, weight[:512], EPS))
    for chosen in (slice(0, 1), slice(4, 7), slice(8, 9)):
        assert same_bits(triton_sublayer_input.sublayer_input(stream[chosen], pre[chosen], weight[:512], EPS),
                         got[chosen])


@pytest.mark.parametrize("batch_invariant,t", [(False, 2), (False, 12), (True, 2)])
def test_the_backend_takes_the_one_launch(batch_invariant, t, monkeypatch):
    """``TritonKernels`` makes a sub-layer's input (plain and FP8-ready rows) and the final norm's without the
    collapse's launch, with the bits of the base class's composition (``hc_collapse``, then the norm)."""
    from model.kernels.backend import KernelBackend

    stream, pre, weight = stream_inputs(t, 4, 256, seed=t)
    kernels = TritonKernels(batch_invariant=batch_invariant)
    composed = KernelBackend.hc_collapse_and_norm_fp8_ready(kernels, stream, pre, weight, EPS)
    final = KernelBackend.hc_collapse_and_norm(kernels, stream, pre, weight, EPS)
    launches = []
    for name in ("hc_collapse", "rms_norm", "rms_norm_and_fp8_ready"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *args, real=real: launches.append(1) or real(*args))
    for got, want in zip(kernels.hc_collapse_and_norm_fp8_ready(stream, pre, weight, EPS), composed, strict=True):
        assert same_bits(got, want)
    assert same_bits(kernels.hc_collapse_and_norm(stream, pre, weight, EPS), final)
    assert launches == []
