"""Triton kernel of Engram's n-gram hashing (twin: ``model.engram.ngram_hash_ids``).

``ngram_hash_ids(compressed, positions, start, offset, slot, history, pad_id, multipliers, primes,
offsets)``: for each token, the compressed ids of its own position and the ``n - 1`` before it
(from its chunk when the position is in it, else from its sequence's history ring, the pad id before
the sequence start); per Engram layer, the rolling XOR of ``id_i * multiplier_i`` (int64) over the
first ``n`` ids, modulo each head's prime for every n-gram size from 2, plus the layer's column
offsets. Integer arithmetic only: the result equals the twin's exactly
(``tests/test_triton_ngram_hash.py``).

Why a kernel: the twin is ~45 small torch operations (three gathers and two ``where``s per looked-back
position, a product, an XOR and a remainder per n-gram size, a concatenation), once per forward; here
one launch, a program per 32 tokens with every layer and head of them.

Layouts: compressed ``[T]`` (each token's compressed id, in the forward's token order), positions,
start (its chunk's first position), offset (the chunk's first row) and slot ``[T]``, history ``[S,
keep]`` (each slot's ring of compressed ids, read only: the caller writes the new ids after), all
int64; multipliers ``[layers, n]``, primes ``[layers, n - 1, heads]``, offsets ``[layers, (n - 1) *
heads]`` int64 -> ``[T, layers, (n - 1) * heads]`` int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per program


@triton.jit
def _ngram_hash_kernel(comp_ptr, pos_ptr, start_ptr, offset_ptr, slot_ptr, hist_ptr, mult_ptr, prime_ptr, offs_ptr,
                       out_ptr, T, keep, stride_hist, pad_id, LAYERS: tl.constexpr, NGRAM: tl.constexpr,
                       HEADS: tl.constexpr, LAYERS_P: tl.constexpr, HEADS_P: tl.constexpr, BLOCK_T: tl.constexpr):
    COLS: tl.constexpr = (NGRAM - 1) * HEADS
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0)
    start = tl.load(start_ptr + t, mask=t_ok, other=0)
    offset = tl.load(offset_ptr + t, mask=t_ok, other=0)
    slot = tl.load(slot_ptr + t, mask=t_ok, other=0)
    layer = tl.arange(0, LAYERS_P)
    head = tl.arange(0, HEADS_P)
    layer_ok = layer < LAYERS
    lh_ok = layer_ok[:, None] & (head < HEADS)[None, :]
    rolling = tl.zeros((BLOCK_T, LAYERS_P), dtype=tl.int64)
    for shift in tl.static_range(NGRAM):
        source = pos - shift
        in_chunk = source >= start
        from_chunk = tl.load(comp_ptr + offset + tl.maximum(source - start, 0), mask=t_ok & in_chunk, other=0)
        from_history = tl.load(hist_ptr + slot * stride_hist + tl.maximum(source, 0) % keep,
                               mask=t_ok & (in_chunk == 0), other=0)
        ids = tl.where(source >= 0, tl.where(in_chunk, from_chunk, from_history), pad_id)
        multiplier = tl.load(mult_ptr + layer * NGRAM + shift, mask=layer_ok, other=0)
        rolling = rolling ^ (ids[:, None] * multiplier[None, :])  # starts at 0: the first product itself
        if shift >= 1:  # the (shift + 1)-gram: every head's bucket, offset into the layer's table
            cols = (shift - 1) * HEADS + head
            prime = tl.load(prime_ptr + layer[:, None] * COLS + cols[None, :], mask=lh_ok, other=1)
            column_offset = tl.load(offs_ptr + layer[:, None] * COLS + cols[None, :], mask=lh_ok, other=0)
            ids_out = rolling[:, :, None] % prime[None, :, :] + column_offset[None, :, :]
            out = out_ptr + t[:, None, None] * (LAYERS * COLS) + layer[None, :, None] * COLS + cols[None, None, :]
            tl.store(out, ids_out, mask=t_ok[:, None, None] & lh_ok[None, :, :])


def ngram_hash_ids(compressed: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, offset: torch.Tensor,
                   slot: torch.Tensor, history: torch.Tensor, pad_id: int, multipliers: torch.Tensor,
                   primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[T, layers, (n - 1) * heads]`` int64 hash ids (module docstring)."""
    t = compressed.shape[0]
    layers, ngram = multipliers.shape
    heads = primes.shape[2]
    out = torch.empty(t, layers, (ngram - 1) * heads, dtype=torch.int64, device=compressed.device)
    if t == 0:
        return out
    args = [x.to(torch.int64).contiguous() for x in (compressed, positions, start, offset, slot)]
    if history.stride(1) != 1:
        raise ValueError("the history ring must be contiguous along its positions")
    _ngram_hash_kernel[(triton.cdiv(t, BLOCK_T),)](
        *args, history, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, t,
        history.shape[1], history.stride(0), int(pad_id), LAYERS=layers, NGRAM=ngram, HEADS=heads,
        LAYERS_P=triton.next_power_of_2(layers), HEADS_P=triton.next_power_of_2(heads), BLOCK_T=BLOCK_T, num_warps=4)
    return out
