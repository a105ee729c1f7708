"""Matrix products of the V4.1 network, with the reference's arithmetic.

Two kinds of product appear in the network:

* **Block-scaled FP8/FP4 GEMMs** (every FP8 dense weight and the FP4 experts): the activation is
  FP8-quantized in groups of 32; for every 32-wide K block the kernel forms the block's partial
  product in fp32, multiplies it by the activation's and the weight's scales and adds it to an fp32
  accumulator, block after block in K order.
* **Plain bf16/fp32 products** (``F.linear`` in the reference: mHC mixes, router, compressor,
  indexer weights, head).

CPU GEMM libraries pick kernels by the number of rows M, so a row's result can change with the
batch it is in. In batch-invariant mode every row is computed as its own one-row product (a
batched ``[1, K] x [K, N]``), which is what the reference computes in a decode step; otherwise the
rows are multiplied together, as the reference does in a prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import fp8_quantize

ACT_BLOCK = 32  # activation quantization group and K block of the FP8/FP4 GEMMs


def block_scaled_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, batch_invariant: bool,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp8_gemm``/``fp4_gemm`` semantics: ``x [..., K]`` bf16 times a quantized weight.

    values: [N, K] fp32, the weight's e4m3 or e2m1 values (unscaled); scales: [N, K/32] fp32, the
    weight's power-of-two scale of each row and K block.
    """
    shape = x.shape
    k = shape[-1]
    n = values.shape[0]
    q, act_scale = fp8_quantize(x.reshape(-1, k), ACT_BLOCK)
    a = q.float()
    m, blocks = a.shape[0], k // ACT_BLOCK
    if batch_invariant:
        # every (row, K block) partial is its own [1, 32] x [32, N] product; the weight block is
        # broadcast over the rows (stride 0), never copied
        partials = [torch.bmm(a[:, b * ACT_BLOCK:(b + 1) * ACT_BLOCK].unsqueeze(1),
                              values[:, b * ACT_BLOCK:(b + 1) * ACT_BLOCK].t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)
                    for b in range(blocks)]
    else:
        partials = [a[:, b * ACT_BLOCK:(b + 1) * ACT_BLOCK] @ values[:, b * ACT_BLOCK:(b + 1) * ACT_BLOCK].T
                    for b in range(blocks)]
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    for block in range(blocks):
        acc += partials[block] * act_scale[:, block:block + 1] * scales[:, block].unsqueeze(0)
    return acc.to(out_dtype).view(*shape[:-1], n)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` computed one row at a time, so a row's result never depends on the batch.

    ``x [M, K]``, ``weight [N, K]`` of the same dtype; result dtype as ``F.linear`` gives.
    """
    m, k = x.shape
    if m == 0:
        return x.new_empty(0, weight.shape[0])
    wt = weight.t().unsqueeze(0).expand(m, k, weight.shape[0])
    return torch.bmm(x.unsqueeze(1), wt).squeeze(1)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """The reference's ``F.linear(x, weight)`` for bf16 or fp32 operands (no quantization)."""
    if not batch_invariant:
        return F.linear(x, weight)
    shape = x.shape
    y = rowwise_linear(x.reshape(-1, shape[-1]), weight)
    return y.view(*shape[:-1], weight.shape[0])
