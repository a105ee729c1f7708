"""Programmatic dependent launch (``model/kernels/triton_dependent_launch.py``, ``--enable-pdl``).

On the CPU: when it is used at all, and how the flag reaches the kernels. (That each kernel waits before
it touches anything an earlier kernel writes is checked on its compiled PTX: ``test_triton_compile.py``.)
On a GPU: chains of products in which every product reads the one before it, launched with and without
it, eagerly and replayed from CUDA graphs, give the same bits; a kernel that read its input before the
previous kernel had written it would not.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.config import EngineConfig
from model.kernels import make_backend
from model.kernels.triton_dependent_launch import dependent_launch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_never_on_the_cpu_nor_when_not_asked_for():
    assert not dependent_launch(True, torch.device("cpu"))
    if torch.cuda.is_available():
        assert not dependent_launch(False, torch.device("cuda"))


def test_the_flag_needs_the_triton_kernels(tiny_checkpoint):
    with pytest.raises(ValueError, match="--enable-pdl needs --kernels triton"):
        EngineConfig(model=str(tiny_checkpoint), device="cpu", enable_pdl=True)
    assert EngineConfig(model=str(tiny_checkpoint), device="cpu", kernels="triton", enable_pdl=True).enable_pdl
    with pytest.raises(ValueError, match="needs the triton kernels"):
        make_backend("reference", batch_invariant=True, pdl=True)
    assert make_backend("triton", batch_invariant=False, pdl=True).pdl


def test_the_backend_passes_it_to_every_kernel_that_takes_it(monkeypatch):
    """Every method whose kernels take it, with and without: every launcher is asked for it exactly when
    the backend has it, and the outputs are the same bits (in the interpreter the kernels then run
    without it; on a GPU with it). One token's products and pairs, the grouped ``wo_a``, the decode form's
    (a product of 3 and of 12 tokens, a pair, the grouped ``wo_a`` with its round trip), RMSNorm, a
    sub-layer's input, SwiGLU and the experts' chain on the tensor cores (with and without the pair sort)."""
    pytest.importorskip("triton")
    from model.config import WeightFormat
    from model.kernels import (ExpertWeights, triton_align_pairs, triton_decode_mm, triton_gemv, triton_mma_experts,
                               triton_moe_sum, triton_rms_norm, triton_scaled_mm, triton_sublayer_input)
    from model.kernels.triton_backend import TritonKernels
    from tests.kernel_checks import device
    from tests.test_triton_kernels import random_weight

    gen = torch.Generator().manual_seed(7)
    usual, dependent = TritonKernels(), TritonKernels(pdl=True)
    to = device()
    w, w2, grouped = (random_weight(WeightFormat.FP8, 64, k, gen) for k in (128, 128, 64))  # grouped: 2 x 32 rows
    for weight in (w, w2, grouped):
        weight.values, weight.scales = weight.values.to(to), weight.scales.to(to)
    experts = usual.prepare_experts(ExpertWeights(*(random_weight(WeightFormat.FP4, 128, 128, gen, experts=4)
                                                    for _ in range(3)), first_expert=0, swiglu_limit=7.0)).to(to)
    x = torch.randn(triton_gemv.MAX_TOKENS + 1, 128, generator=gen).bfloat16().to(to)  # the decode form's fewest
    decode_rows = torch.randn(12, 128, generator=gen).bfloat16().to(to)
    stream = torch.randn(len(x), 4, 128, generator=gen).bfloat16().to(to)
    mix = torch.rand(len(x), 4, generator=gen).to(to)
    norm = torch.randn(128, generator=gen).bfloat16().to(to)  # (a model weight: read before the wait)
    pairs = (torch.arange(2, device=to), torch.tensor([1, 3], device=to), torch.tensor([0.5, 0.25], device=to))
    sorted_pairs = (torch.arange(12, device=to) % 2, torch.arange(12, device=to) % 4,  # past the unsorted steps
                    torch.rand(12, generator=gen).to(to))
    calls = [lambda k: k.quantized_linear(x[:1], w), lambda k: k.quantized_linears(x[:1], [w, w2]),
             lambda k: k.grouped_dequantized_linear(x[:1].view(1, 2, 64), grouped),
             lambda k: k.quantized_linear(x, w), lambda k: k.quantized_linear(decode_rows, w),
             lambda k: k.quantized_linears(decode_rows, [w, w2]),
             lambda k: k.grouped_dequantized_linear(decode_rows.view(-1, 2, 64), grouped, fp8_ready=True),
             lambda k: k.rms_norm(x, norm, 1e-6), lambda k: k.hc_collapse_and_norm(stream, mix, norm, 1e-6),
             lambda k: k.swiglu(x[:, :64], x[:, 64:], 7.0), lambda k: k.expert_outputs(x, *pairs, experts),
             lambda k: k.expert_outputs(x, *sorted_pairs, experts)]
    asked = []  # (launcher's module, whether it was asked for dependent launch)
    launchers = (triton_gemv, triton_decode_mm, triton_mma_experts, triton_scaled_mm,
                 triton_align_pairs, triton_rms_norm, triton_sublayer_input, triton_moe_sum)
    for module in launchers:
        real = module.launch_arguments
        def recorded(pdl, device, module=module, real=real):
            asked.append((module, pdl))
            return real(pdl, device)
        monkeypatch.setattr(module, "launch_arguments", recorded)
    for call in calls:
        asked.clear()
        expected = call(usual)
        assert asked and not any(pdl for _, pdl in asked)
        asked.clear()
        got = call(dependent)
        assert asked and all(pdl for _, pdl in asked)
        expected, got = (out if isinstance(out, list) else [out] for out in (expected, got))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    asked.clear()
    for call in calls:
        call(dependent)
    assert {module for module, _ in asked} == set(launchers)  # every launcher of the list took part


def _chain_outputs(kernels, x: torch.Tensor, weights) -> list[torch.Tensor]:
    """Each product's input is the previous product's output: nothing runs between them."""
    outs = []
    for w in weights:
        x = kernels.quantized_linear(x, w)
        outs.append(x)
    return outs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 12, 64])  # triton_gemv (one or two rows); the decode form
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])  # with its split sums
def test_chained_products_give_the_same_bits_with_dependent_launch(tokens, graph):
    from benchmarks.kernel_inputs import fp8_weight  # outputs of about the inputs' magnitude
    from model.kernels.triton_backend import TritonKernels

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    # wide and narrow products, K split many ways (the split counters) and not at all
    sizes = [5120, 512, 5120, 1280, 8192, 5120, 2304, 5120]
    weights = [fp8_weight(n, k, 1.0, torch.device("cuda"), gen) for k, n in zip(sizes, sizes[1:])]
    x = torch.randn(tokens, sizes[0], device="cuda", generator=gen).bfloat16()
    usual, dependent = TritonKernels(), TritonKernels(pdl=True)
    expected = _chain_outputs(usual, x, weights)
    assert all(out.isfinite().all() for out in expected)
    if not graph:
        for _ in range(20):
            assert all(torch.equal(a, b) for a, b in zip(_chain_outputs(dependent, x, weights), expected))
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain_outputs(dependent, x, weights)  # compiled outside the capture
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, stream=stream):
            captured = _chain_outputs(dependent, x, weights)
        for _ in range(20):
            for out in captured:
                out.zero_()  # a stale input would then show
            cuda_graph.replay()
            stream.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, expected))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [4, 12])  # without the pair sort, with it
def test_chained_experts_give_the_same_bits_with_dependent_launch(tokens):
    """Routed experts on the tensor cores fed from registers (``triton_mma_experts``), each call's tokens
    the previous call's outputs and its experts picked from them inside the graph (as the routing
    does, right before the experts' chain), one pair per token, in a CUDA graph. Without the sort the
    kernels load their first weights before their wait, at experts written two launches back."""
    from model.config import WeightFormat
    from model.kernels import ExpertWeights, QuantizedWeight, triton_mma_experts
    from model.kernels.triton_backend import TritonKernels

    d, inter, experts, calls = 5120, 2304, 16, 4
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fp4_stack(n: int, k: int) -> QuantizedWeight:
        packed = torch.randint(-128, 128, (experts, n, k // 2), device="cuda", generator=gen, dtype=torch.int8)
        exponents = torch.randint(117, 121, (experts, n, k // 32), device="cuda", generator=gen, dtype=torch.uint8)
        return QuantizedWeight(packed, exponents.view(torch.float8_e8m0fnu), WeightFormat.FP4)

    usual, dependent = TritonKernels(), TritonKernels(pdl=True)
    stack = usual.prepare_experts(ExpertWeights(fp4_stack(inter, d), fp4_stack(inter, d), fp4_stack(d, inter),
                                                first_expert=0, swiglu_limit=10.0))
    assert triton_mma_experts.takes(stack)  # (and <= 4 pairs per expert: the backend takes that kernel)
    pair_token = torch.arange(tokens, device="cuda")
    pair_expert = [torch.randint(0, experts, (tokens,), device="cuda", generator=gen) for _ in range(calls)]
    pair_weight = torch.rand(tokens, device="cuda", generator=gen)
    x = torch.randn(tokens, d, device="cuda", generator=gen).bfloat16()

    def chain(kernels) -> list[torch.Tensor]:
        outs, rows = [], x
        for ids in pair_expert:
            ids = (ids + rows[:, 0].view(torch.int16).to(torch.int64)).remainder(experts)  # on the device
            rows = kernels.expert_outputs(rows, pair_token, ids, pair_weight, stack)
            outs.append(rows)
        return outs

    expected = chain(usual)
    assert all(out.isfinite().all() for out in expected) and expected[-1].abs().max() > 0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(dependent)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, stream=stream):
            captured = chain(dependent)
        for _ in range(20):
            for out in captured:
                out.zero_()
            cuda_graph.replay()
            stream.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, expected))


@pytest.mark.gpu
@needs_cuda
def test_the_engine_gives_the_same_tokens_with_dependent_launch(tiny_checkpoint):
    """The whole decode step (its CUDA graphs, every kernel between the products) with and without it."""
    from engine_core.protocol import SamplingParams
    from frontend.llm import LLM

    prompts = [list(range(3, 40))] + [list(range(5, 5 + n)) for n in (7, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    runs = []
    for pdl in (False, True):
        with LLM(str(tiny_checkpoint), device="cuda", enable_pdl=pdl, max_num_batched_tokens=64) as llm:
            runs.append([(out.token_ids, out.logprobs) for out in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
