"""``tests/triton_interpreter.py``: the interpreter's helper calls skip re-patching the language, with
the same bits, and a launch still leaves ``triton.language`` as it found it; a loop whose bounds depend on
the program runs in any interpreter under any NumPy."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter only")


def _gemv_output():
    from model.config import WeightFormat
    from model.kernels.triton_gemv import fp8_gemv
    from tests.test_triton_kernels import random_weight

    gen = torch.Generator().manual_seed(3)
    first, second = random_weight(WeightFormat.FP8, 64, 256, gen), random_weight(WeightFormat.FP8, 32, 256, gen)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    return fp8_gemv(x, [(first.values, first.scales), (second.values, second.scales)], quantize=True)


def test_the_skip_is_installed_and_gives_the_same_bits(monkeypatch):
    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_patch_builtin", "_LangPatchScope")):
        pytest.skip("another Triton's interpreter: the skip is not installed (tests/triton_interpreter.py)")
    skipping = interpreter._patch_lang
    assert getattr(skipping, "skips_repeats", False)  # installed by conftest.py
    builtin_load = tl.load
    walks = []  # the interpreter's walks over a language module, one per module patched
    walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: walks.append(1) or walk(*args))
    fast = _gemv_output()
    fast_walks = len(walks)
    assert tl.load is builtin_load  # the launch undid its patching
    monkeypatch.setattr(interpreter, "_patch_lang", skipping.original)  # Triton's own: patch at every call
    slow = _gemv_output()
    slow_walks = len(walks) - fast_walks
    assert tl.load is builtin_load
    assert torch.equal(fast, slow)
    assert 0 < fast_walks * 10 < slow_walks, (fast_walks, slow_walks)  # the launch patched; its helpers did not


def test_a_loop_bounded_by_the_program_id_runs():
    """``range`` over bounds derived from ``tl.program_id``: what every split-K kernel's loop does, and what
    Triton 3.6's interpreter refused under NumPy 2.4 until ``index_one_element_arrays`` (conftest.py)."""
    import triton
    import triton.language as tl

    @triton.jit
    def count_up(out_ptr, n):
        pid = tl.program_id(0)
        total = 0
        for i in range(pid, tl.minimum(pid + 3, n)):
            total += i
        tl.store(out_ptr + pid, total)

    out = torch.zeros(5, dtype=torch.int32)
    count_up[(5,)](out, 5)
    assert out.tolist() == [sum(range(p, min(p + 3, 5))) for p in range(5)]
