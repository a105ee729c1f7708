"""GPU checks (skipped without CUDA): the model on CUDA against the reference and against itself."""

from __future__ import annotations

import io

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_parity_on_cuda(golden_dir):
    """cuBLAS sums in another order than the CPU reference, and the tiny golden model turns one-ulp
    differences into logit jumps of up to ~0.5 (the reference against itself shows the same), so
    bit equality is out of reach on the GPU. Measured on one H200: 97% top-1 agreement over all
    judged rows. Guard that level, and that no row is off by more than a chaotic jump."""
    from model.parity import run_parity

    out = io.StringIO()
    report = run_parity(golden_dir, batch_invariant=False, components=False, out=out, device="cuda")
    print(out.getvalue())
    assert report.total.top1_rate >= 0.95, out.getvalue()
    assert report.total.max_abs < 1.0, out.getvalue()


def test_batch_invariance_on_cuda(tiny_checkpoint):
    """Row-wise GEMMs on the GPU: the same request gives the same tokens alone and in a batch."""
    from engine_core.protocol import SamplingParams
    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", batch_invariant=True, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    alone = llm.generate([list(range(3, 40))], params, use_tqdm=False)[0].token_ids
    prompts = [list(range(3, 40))] + [list(range(5, 5 + n)) for n in (7, 19, 33, 64, 90)]
    batched = llm.generate(prompts, params, use_tqdm=False)[0].token_ids
    assert alone == batched
