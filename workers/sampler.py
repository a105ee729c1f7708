"""Batched, deterministic token sampler (run by the model runner after each forward step).

One row per sequence being sampled. Processing order, per row:

  1. penalties, as vLLM applies them:
       repetition: for tokens seen in the prompt or the output, positive logits are
                   divided by the penalty and negative ones multiplied by it;
       frequency:  logit -= frequency_penalty * count(token in output);
       presence:   logit -= presence_penalty * (count(token in output) > 0);
  2. logit bias (added);
  3. greedy rows (temperature ~ 0): argmax of the processed logits, ties -> lowest id;
  4. sampled rows: divide by temperature, then top-k, then top-p (keep the smallest
     most-probable set whose cumulative probability >= top_p; the top token always stays),
     then min-p (drop tokens whose prob < min_p * max prob), then Gumbel-max:
       token = argmax(log_softmax(masked logits) + g),  g = -log(-log(u)),
     with u a counter-based hash of (seed, position, token_id) (see sampling_noise).

Determinism: every op is row-wise (no reduction across rows) and the noise never uses
torch's RNG nor the row index, so a row's token depends only on (its logits, its params,
seed, position): not on batch size, batch order, chunking or step history. The noise is
bitwise identical on CPU and CUDA; the float ops around it (softmax, sort, cumsum, log)
may differ between devices by an ulp, which can only flip a draw at an exact near-tie.

Logprobs are reported from log_softmax of the ORIGINAL, unmodified logits, i.e. the
model's own distribution, not the penalised / tempered / truncated one that was sampled
from. That is vLLM's default ("raw_logprobs") and what OpenAI clients expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers import sampling_noise
from engine_core.protocol import GREEDY_TEMPERATURE_EPS, SamplingParams, random_seed
from workers.sampling_params_tensors import RowSpec, SamplingBatch  # re-exported: the sampler's public API

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "PromptLogprobs",
    "RowSpec",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "apply_penalties_and_bias",
    "filter_logits",
    "gumbel_argmax",
    "prompt_logprobs",
    "random_seed",
    "sample",
]

# Upper bound on elements of one [rows, V] noise chunk: bounds the int64/float64 temporaries
# of the hash (~128 MiB each) when a large batch meets a ~130k vocabulary.
_NOISE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] f32, logprob of the sampled token under the raw logits
    # Top-N of the raw log-softmax, N = the largest `logprobs` requested in the batch;
    # each row reads its own first params.logprobs columns. None when N == 0.
    top_logprob_ids: torch.Tensor | None  # [R, N] int64, most probable first
    top_logprobs: torch.Tensor | None  # [R, N] f32


@dataclass(frozen=True)
class PromptLogprobs:
    token_logprobs: torch.Tensor  # [T] f32
    top_ids: torch.Tensor  # [T, n] int64 (n may be 0)
    top_logprobs: torch.Tensor  # [T, n] f32


def apply_penalties_and_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-2 above on [R, V] logits; returns a new tensor, the input is not modified.

    Rows without a penalty carry neutral values (1.0 / 0.0), which leave their logits
    bit-for-bit unchanged, so the ops can run on the whole batch.
    """
    x = logits
    if batch.seen_mask is not None:
        rp = batch.repetition_penalty[:, None]
        x = torch.where(batch.seen_mask, torch.where(x > 0, x / rp, x * rp), x)
    if batch.output_counts is not None:
        counts = batch.output_counts
        x = x - batch.frequency_penalty[:, None] * counts
        x = x - batch.presence_penalty[:, None] * (counts > 0).to(x.dtype)
    if batch.bias_rows is not None:
        # (row, token) pairs are unique, so accumulate is order-free on every device.
        x = x.index_put((batch.bias_rows, batch.bias_tokens), batch.bias_values, accumulate=True)
    return x


def filter_logits(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top_k_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p on temperature-scaled logits [S, V]; dropped -> -inf.

    top_k [S] int64 (V = off), top_p [S] float (>= 1 = off), min_p [S] float (0 = off).
    The use_* flags only skip work when no row needs it; a row with its filter off gets an
    all-False mask either way, so the flags never change a row's result.
    """
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)  # a fill, not a host copy
    if use_top_k_top_p:
        # Stable descending sort: equal logits keep id order, so the cut is well defined.
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        rank = torch.arange(x.shape[-1], device=x.device)
        drop = rank[None, :] >= top_k[:, None]
        sorted_x = torch.where(drop, neg_inf, sorted_x)
        # Top-p on the distribution left after top-k. float64 for the running sum: 130k
        # small terms in fp32 drift enough to move the cut.
        probs = torch.softmax(sorted_x.to(torch.float64), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix sum
        top_p64 = top_p.to(torch.float64)[:, None]
        drop_p = (mass_before >= top_p64) & (top_p64 < 1.0)
        drop_p[:, 0] = False  # the most probable token always survives
        drop = drop | drop_p
        mask = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocab order
        x = torch.where(mask, neg_inf, x)
    if use_min_p:
        probs = torch.softmax(x, dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        x = torch.where(probs < threshold, neg_inf, x)
    return x


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, mixed_tokens: torch.Tensor) -> torch.Tensor:
    """argmax(log_softmax(x) + Gumbel noise) per row: an exact draw from softmax(x).

    The noise of row i is a function of keys[i] (= hash of seed and position) only.
    """
    num_rows, vocab = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    step = max(1, _NOISE_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, step):
        end = min(start + step, num_rows)
        logp = torch.log_softmax(x[start:end], dim=-1).to(torch.float64)
        noise = sampling_noise.gumbel_noise(keys[start:end], mixed_tokens)
        out[start:end] = torch.argmax(logp + noise, dim=-1)
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Choose one token per row of logits [R, V] (fp32) following the module docstring."""
    if logits.dim() != 2 or tuple(logits.shape) != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits shape {tuple(logits.shape)} != {(batch.num_rows, batch.vocab_size)}")
    logits = logits.to(torch.float32)
    processed = apply_penalties_and_bias(logits, batch)
    n = min(batch.max_num_logprobs, batch.vocab_size)
    if logits.is_cuda:
        # two launches for any number of rows, where torch reduces each row in one block (slow for a
        # few rows); its argmax is torch's, its logprobs torch's to a few ulps (triton_greedy.py).
        # Every row takes this path whatever the other rows ask for: a row's logprob computed by
        # torch's log_softmax when another row of the step wanted top logprobs, by this kernel
        # otherwise, would depend on its batch by those ulps
        from model.kernels.triton_greedy import row_lse_and_argmax

        raw_logprobs = None
        lse, token_ids = row_lse_and_argmax(logits, processed)
    else:
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # the model's distribution (see top)
        # torch.argmax returns the first maximal index: ties go to the lowest token id.
        token_ids = torch.argmax(processed, dim=-1)
    rows = batch.sample_rows
    if rows.numel() > 0:
        x = processed.index_select(0, rows) / batch.temperature.index_select(0, rows)[:, None]
        x = filter_logits(
            x,
            batch.top_k.index_select(0, rows),
            batch.top_p.index_select(0, rows),
            batch.min_p.index_select(0, rows),
            batch.use_top_k_top_p,
            batch.use_min_p,
        )
        drawn = gumbel_argmax(x, batch.keys.index_select(0, rows), batch.mixed_tokens)
        token_ids = token_ids.index_copy(0, rows, drawn)

    top_ids = top_vals = None
    if raw_logprobs is None:
        chosen = logits.gather(1, token_ids[:, None]).squeeze(1) - lse
        if n > 0:  # the same subtraction as the chosen token's: the two lists agree bit for bit
            top_logits, top_ids = torch.topk(logits, n, dim=-1, largest=True, sorted=True)
            top_vals = top_logits - lse[:, None]
    else:
        chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        if n > 0:
            top_vals, top_ids = torch.topk(raw_logprobs, n, dim=-1, largest=True, sorted=True)
    return SamplerOutput(token_ids, chosen, top_ids, top_vals)


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, n: int) -> PromptLogprobs:
    """Logprob of each next prompt token and the top-n alternatives at each position.

    logits[t] is the model's prediction for target_ids[t] (for a prompt p, the caller
    passes the logits of positions 0..T-1 and target_ids = p[1..T]). Raw logits, no
    sampling parameters applied, like the sampled-token logprobs.
    """
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree")
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_lp = logp.gather(1, target_ids.to(torch.int64)[:, None]).squeeze(1)
    n = min(max(n, 0), logits.shape[1])
    top_vals, top_ids = torch.topk(logp, n, dim=-1, largest=True, sorted=True)
    return PromptLogprobs(token_lp, top_ids, top_vals)
