"""The sampler's row reductions over the vocabulary on CUDA: each row's log-normalizer and argmax.

``row_lse_and_argmax(raw, processed)``: for logits ``[R, V]`` fp32, each row's ``logsumexp(raw)``
(the chosen token's logprob is ``raw[token] - lse``: the sampler reports logprobs of the raw
logits) and ``argmax(processed)`` (the greedy token; ties to the lowest id, as ``torch.argmax``).
Twins: ``torch.logsumexp`` / ``torch.log_softmax`` and ``torch.argmax`` (``workers/sampler.py``).

Why: torch reduces a row with one thread block, so at one row a V4.1 vocabulary (129,280 logits)
takes ~30 µs for ``log_softmax`` and as long again for ``argmax`` on one H200, while the 0.5 MB
read takes a fraction of a microsecond. Here ``CHUNK`` logits per program, many programs per row,
then one small program per row joins them.

Arithmetic: per chunk its maximum and ``sum(exp(x - max))`` (CUDA's ``expf``), joined as
``M = max(max_c)``, ``lse = M + log(sum_c(s_c * exp(max_c - M)))``: the same function as torch's,
other fp32 roundings (a few ulps of the logprob). The argmax is exact: each chunk's first maximal
index, the chunks taken in order, a later one only if strictly larger. A row of -inf gives
``lse = -inf`` and token 0, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRETED, exp_f32

CHUNK = 4096  # logits per program: a V4.1 row is 32 programs


@triton.jit
def _chunk_kernel(raw_ptr, processed_ptr, part_ptr, V, stride_raw, stride_processed, chunks,
                  CHUNK: tl.constexpr, SAME: tl.constexpr, INTERPRETED: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    raw = tl.load(raw_ptr + row * stride_raw + cols, mask=ok, other=-float("inf"))
    top = tl.max(raw, axis=0)
    shifted = tl.where(ok, raw - tl.where(top == -float("inf"), 0.0, top), -float("inf"))
    total = tl.sum(exp_f32(shifted, INTERPRETED), axis=0)
    if SAME:
        processed = raw
    else:
        processed = tl.load(processed_ptr + row * stride_processed + cols, mask=ok, other=-float("inf"))
    best = tl.max(processed, axis=0)
    # the first maximal column (columns past V read -inf and come after every real one, so they never
    # come first)
    first = tl.min(tl.where(processed == best, cols, 1 << 30), axis=0)
    out = part_ptr + (row * chunks + chunk) * 4
    tl.store(out, top)
    tl.store(out + 1, total)
    tl.store(out + 2, best)
    tl.store(out + 3, first.to(tl.float32))  # exact: V < 2**24


@triton.jit
def _join_kernel(part_ptr, lse_ptr, token_ptr, chunks, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < chunks
    base = part_ptr + (row * chunks + c) * 4
    tops = tl.load(base, mask=ok, other=-float("inf"))
    totals = tl.load(base + 1, mask=ok, other=0.0)
    bests = tl.load(base + 2, mask=ok, other=-float("inf"))
    firsts = tl.load(base + 3, mask=ok, other=0.0)
    top = tl.max(tops, axis=0)
    finite = tl.where(top == -float("inf"), 0.0, top)
    scaled = tl.where(ok & (tops > -float("inf")), totals * exp_f32(tops - finite, INTERPRETED), 0.0)
    lse = finite + tl.log(tl.sum(scaled, axis=0))
    best = tl.max(bests, axis=0)
    # the first chunk reaching the best value holds the first maximal column
    winner = tl.min(tl.where(ok & (bests == best), c, BLOCK), axis=0)
    token = tl.sum(tl.where(c == winner, firsts, 0.0), axis=0)
    tl.store(lse_ptr + row, lse)
    tl.store(token_ptr + row, token.to(tl.int64))


def row_lse_and_argmax(raw: torch.Tensor, processed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``logsumexp(raw, -1)`` fp32 ``[R]``, ``argmax(processed, -1)`` int64 ``[R]``) of fp32 ``[R, V]``
    logits (``processed`` may be ``raw`` itself)."""
    rows, vocab = raw.shape
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    same = processed is raw or (processed.data_ptr() == raw.data_ptr() and processed.stride() == raw.stride())
    if not same and processed.stride(-1) != 1:
        processed = processed.contiguous()
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    token = torch.empty(rows, dtype=torch.int64, device=raw.device)
    if rows == 0:
        return lse, token
    if vocab >= 1 << 24:
        raise ValueError(f"row_lse_and_argmax carries column indices in fp32: vocabulary {vocab} too large")
    chunks = triton.cdiv(vocab, CHUNK)
    partials = torch.empty(rows, chunks, 4, dtype=torch.float32, device=raw.device)
    _chunk_kernel[(rows, chunks)](raw, processed, partials, vocab, raw.stride(0), processed.stride(0), chunks,
                                  CHUNK=CHUNK, SAME=same, INTERPRETED=INTERPRETED, num_warps=8)
    _join_kernel[(rows,)](partials, lse, token, chunks, BLOCK=max(16, triton.next_power_of_2(chunks)),
                          INTERPRETED=INTERPRETED, num_warps=1)
    return lse, token
