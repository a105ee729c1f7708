"""Batch invariance of the GEMMs in the engine's CPU mode (``batch_invariant=True``).

Every row's result must be bitwise the same whether the row is multiplied alone, in a batch of M
rows, or in any other subset/order of rows, for any M, dtype, K and N, and whatever the number of
intra-op threads. In one-row products the batch-invariant path must also equal the plain path
(which is what the reference computes in a decode step).
"""

from __future__ import annotations

import pytest
import torch

from model.gemm import block_scaled_linear, dense_linear
from model.quant import E2M1_SIGNED

# one intra-op thread (see conftest); the thread-count test switches to 2 itself
pytestmark = pytest.mark.usefixtures("single_thread")

M_MAX = 200
M_VALUES = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 199, 200]
DENSE_SHAPES = [(16, 8), (32, 48), (256, 512), (96, 1024), (1024, 40)]  # (K, N)
SCALED_SHAPES = [(32, 16), (256, 512), (128, 40), (512, 96)]  # K multiple of 32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weight values (fp32) and power-of-two scales per row and 32-block of K."""
    g = gen(seed)
    values = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    scales = torch.exp2(torch.randint(-12, -4, (n, k // 32), generator=g).float())
    return values, scales


def fp4_operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    values = E2M1_SIGNED[torch.randint(0, 16, (n, k), generator=g)]
    scales = torch.exp2(torch.randint(-8, -2, (n, k // 32), generator=g).float())
    return values, scales


def assert_rows_independent(fn, x: torch.Tensor, seed: int) -> None:
    """fn(x[rows]) == fn(x)[rows] bitwise for single rows, prefixes of every size and shuffled subsets."""
    full = fn(x)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(alone, full), f"rows alone differ from the batch of {x.shape[0]}: " \
                                     f"max abs {(alone.double() - full.double()).abs().max().item():g}"
    g = gen(seed)
    for m in M_VALUES:
        assert torch.equal(fn(x[:m]), full[:m]), f"first {m} rows differ from the same rows in the full batch"
        subset = torch.randperm(x.shape[0], generator=g)[:m]
        assert torch.equal(fn(x[subset]), full[subset]), f"shuffled subset of {m} rows differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", DENSE_SHAPES)
def test_dense_linear_rows_are_batch_invariant(dtype: torch.dtype, k: int, n: int) -> None:
    g = gen(k * 7 + n)
    x = torch.randn(M_MAX, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    assert_rows_independent(lambda a: dense_linear(a, w, batch_invariant=True), x, seed=n)
    out = dense_linear(x, w, batch_invariant=True)
    assert out.dtype == dtype and out.shape == (M_MAX, n)
    # leading dimensions are only flattened: a [2, 100, K] input gives the same rows
    assert torch.equal(dense_linear(x.view(2, M_MAX // 2, k), w, True).reshape(M_MAX, n), out)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("k,n", SCALED_SHAPES)
def test_block_scaled_linear_rows_are_batch_invariant(out_dtype: torch.dtype, fmt: str, k: int, n: int) -> None:
    values, scales = (fp8_operands if fmt == "fp8" else fp4_operands)(n, k, seed=k + n)
    x = (torch.randn(M_MAX, k, generator=gen(n)) * 3).to(torch.bfloat16)
    x[5, :32] = 0  # a zero activation group
    x[9] *= 1000  # a row with a very different scale (scales are per row and group)
    fn = lambda a: block_scaled_linear(a, values, scales, batch_invariant=True, out_dtype=out_dtype)  # noqa: E731
    assert_rows_independent(fn, x, seed=k)
    assert fn(x).dtype == out_dtype


def test_results_do_not_depend_on_the_thread_count() -> None:
    g = gen(3)
    x32 = torch.randn(M_MAX, 1024, generator=g)
    w32 = torch.randn(1024, 1024, generator=g) * 1024 ** -0.5
    xb, wb = x32.bfloat16(), w32.bfloat16()
    values, scales = fp8_operands(768, 512, seed=4)
    xq = (torch.randn(M_MAX, 512, generator=g) * 3).bfloat16()

    def compute():
        return [dense_linear(x32, w32, True), dense_linear(xb, wb, True),
                block_scaled_linear(xq, values, scales, True)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compute()
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = compute()
    finally:
        torch.set_num_threads(before)
    for i, (p, q) in enumerate(zip(one, two)):
        assert torch.equal(p, q), f"result {i} changes with the number of threads"


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_block_scaled_linear_single_row_equals_plain_path(fmt: str) -> None:
    """A one-row product is the same whether computed batch-invariantly or plainly (the reference's
    decode step), so the engine's decode reproduces the reference's decode."""
    values, scales = (fp8_operands if fmt == "fp8" else fp4_operands)(96, 256, seed=11)
    x = (torch.randn(24, 256, generator=gen(12)) * 2).to(torch.bfloat16)
    for i in range(x.shape[0]):
        row = x[i:i + 1]
        assert torch.equal(block_scaled_linear(row, values, scales, batch_invariant=False),
                           block_scaled_linear(row, values, scales, batch_invariant=True)), f"row {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_single_row_equals_plain_path(dtype: torch.dtype) -> None:
    g = gen(13)
    w = torch.randn(512, 256, generator=g).to(dtype)
    x = torch.randn(16, 256, generator=g).to(dtype)
    for i in range(x.shape[0]):
        assert torch.equal(dense_linear(x[i:i + 1], w, False), dense_linear(x[i:i + 1], w, True)), f"row {i}"


def test_block_scaled_linear_matches_its_definition() -> None:
    """Sanity of the operands: the result is the dequantized product up to fp32/bf16 rounding
    (a scale or nibble mix-up would be off by factors)."""
    values, scales = fp8_operands(64, 128, seed=21)
    x = (torch.randn(8, 128, generator=gen(22))).to(torch.bfloat16)
    w = values * scales.repeat_interleave(32, 1)
    from model.quant import fp8_qdq

    expected = fp8_qdq(x, 32).float() @ w.t()
    got = block_scaled_linear(x, values, scales, batch_invariant=True, out_dtype=torch.float32)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_invariance_checks_have_teeth() -> None:
    """The plain fp32 path (``F.linear``) rounds differently with the number of rows on this CPU,
    which is why the checks above are meaningful; skipped where the BLAS happens to be invariant."""
    g = gen(31)
    x = torch.randn(M_MAX, 256, generator=g)
    w = torch.randn(512, 256, generator=g)
    try:
        assert_rows_independent(lambda a: dense_linear(a, w, batch_invariant=False), x, seed=1)
    except AssertionError:
        return
    pytest.skip("F.linear is batch-invariant on this machine: nothing to contrast with")
