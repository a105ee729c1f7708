"""Per-request sampling parameters and their per-step batched tensor form.

SamplingParams is the wire type of engine_core.protocol (re-exported by workers.sampler). SamplingBatch turns one step's rows into device tensors
once, so the sampler itself is a fixed sequence of batched tensor ops.

Every per-row tensor is chosen so that a row whose feature is off is left bit-for-bit
unchanged by that feature's op (penalty 1.0 / 0.0, top_k = V, top_p = 1.0, min_p = 0.0).
That is what lets the sampler apply an op to the whole batch when any row needs it,
without a row's result depending on its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers import sampling_noise
from model.device_upload import upload, upload_many

# SamplingParams travels in step plans, so it lives with the other wire types.
from engine_core.protocol import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class RowSpec:
    """One row of a sampling step: a sequence about to get its next token."""

    params: SamplingParams
    seed: int  # effective seed: params.seed, or the engine's random_seed()
    position: int  # absolute index in the sequence of the token being sampled
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class SamplingBatch:
    """All per-row sampling tensors for one step, built once on the target device."""

    num_rows: int
    vocab_size: int
    device: torch.device
    # Greedy rows take argmax of the processed logits; sample_rows lists the others.
    sample_rows: torch.Tensor  # [S] int64
    temperature: torch.Tensor  # [R] f32 (1.0 on greedy rows, never used there)
    top_k: torch.Tensor  # [R] int64, vocab_size when disabled
    top_p: torch.Tensor  # [R] f64 (the user's value exactly), 1.0 when disabled
    min_p: torch.Tensor  # [R] f32, 0.0 when disabled
    use_top_k_top_p: bool  # any row needs the sort-based filters
    use_min_p: bool
    keys: torch.Tensor  # [R] int64 hash key of (seed, position)
    mixed_tokens: torch.Tensor  # [V] int64 pre-mixed token ids
    # Penalties: None when no row in the batch uses them.
    repetition_penalty: torch.Tensor | None  # [R] f32
    seen_mask: torch.Tensor | None  # [R, V] bool, token in prompt or output
    frequency_penalty: torch.Tensor | None  # [R] f32
    presence_penalty: torch.Tensor | None  # [R] f32
    output_counts: torch.Tensor | None  # [R, V] f32 counts over output tokens
    # Logit bias as a sparse (row, token, value) list: requests bias a handful of tokens,
    # so this beats a dense [R, V] tensor; (row, token) pairs are unique per batch.
    bias_rows: torch.Tensor | None  # [M] int64
    bias_tokens: torch.Tensor | None  # [M] int64
    bias_values: torch.Tensor | None  # [M] f32
    max_num_logprobs: int  # N of the top-logprobs output (0 => none)

    @staticmethod
    def build(rows: Sequence[RowSpec], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        device = torch.device(device)
        R, V = len(rows), vocab_size
        params = [r.params for r in rows]

        greedy = [p.is_greedy for p in params]
        sample_rows = torch.tensor([i for i, g in enumerate(greedy) if not g], dtype=torch.int64)
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [V if p.top_k <= 0 else min(p.top_k, V) for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]

        for r in rows:
            if not 0 <= r.position <= sampling_noise.MASK32:
                raise ValueError(f"position must be in [0, 2**32), got {r.position}")
        seed_words = [sampling_noise.split_seed(r.seed) for r in rows]
        # numpy arrays: the same integer arithmetic as on tensors, at a third of the host time
        # (~25 tiny ops every step: 194 -> 56 us for one row on a 2-core CPU)
        keys = sampling_noise.row_keys(
            np.array([w[0] for w in seed_words], dtype=np.int64),
            np.array([w[1] for w in seed_words], dtype=np.int64),
            np.array([r.position for r in rows], dtype=np.int64),
        )

        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        seen_mask = output_counts = None
        if use_rep:
            seen_mask = _token_mask(rows, V, device)
        if use_counts:
            output_counts = _output_counts(rows, V, device)

        bias_rows, bias_tokens, bias_values = _logit_bias(params, V, device)
        # every per-row parameter in one copy (``upload_many``): a decode step pays one, not six to nine
        per_row = {"sample_rows": (sample_rows, torch.int64), "temperature": (temperature, torch.float32),
                   "top_k": (top_k, torch.int64), "top_p": (top_p, torch.float64),
                   "min_p": (min_p, torch.float32), "keys": (keys, torch.int64)}
        for name, used in (("repetition_penalty", use_rep), ("frequency_penalty", use_counts),
                           ("presence_penalty", use_counts)):
            if used:
                per_row[name] = ([getattr(p, name) for p in params], torch.float32)
        on_device = dict(zip(per_row, upload_many(list(per_row.values()), device)))
        return SamplingBatch(
            num_rows=R,
            vocab_size=V,
            device=device,
            sample_rows=on_device["sample_rows"],
            temperature=on_device["temperature"],
            top_k=on_device["top_k"],
            top_p=on_device["top_p"],
            min_p=on_device["min_p"],
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            keys=on_device["keys"],
            mixed_tokens=sampling_noise.token_mix(V, device),
            repetition_penalty=on_device.get("repetition_penalty"),
            seen_mask=seen_mask,
            frequency_penalty=on_device.get("frequency_penalty"),
            presence_penalty=on_device.get("presence_penalty"),
            output_counts=output_counts,
            bias_rows=bias_rows,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        )


def _flat_token_index(rows: Sequence[RowSpec], vocab_size: int, with_prompt: bool) -> torch.Tensor:
    """Token ids of every row as indices into a flattened [R, V] tensor (CPU int64)."""
    parts = []
    for i, r in enumerate(rows):
        seqs = (r.prompt_token_ids, r.output_token_ids) if with_prompt else (r.output_token_ids,)
        for seq in seqs:
            ids = torch.as_tensor(seq, dtype=torch.int64).reshape(-1)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"row {i}: token id out of range [0, {vocab_size})")
            parts.append(ids + i * vocab_size)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _token_mask(rows: Sequence[RowSpec], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] bool: the token occurs in the row's prompt or output (repetition penalty)."""
    index = upload(_flat_token_index(rows, vocab_size, with_prompt=True), torch.int64, device)
    mask = torch.zeros(len(rows) * vocab_size, dtype=torch.bool, device=device)
    mask.scatter_(0, index, True)  # duplicates all write True: order-independent; no host value copied
    return mask.view(len(rows), vocab_size)


def _output_counts(rows: Sequence[RowSpec], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] f32 occurrence counts over output tokens (frequency / presence penalties).

    scatter_add of 1.0s is exact for counts below 2**24, so device atomics cannot make
    the result order-dependent.
    """
    index = upload(_flat_token_index(rows, vocab_size, with_prompt=False), torch.int64, device)
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(len(rows), vocab_size)


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    rows, tokens, values = [], [], []
    for i, p in enumerate(params):
        # int() first: JSON objects carry keys as strings; the dict then dedupes them so
        # each (row, token) pair appears once and the scatter below is order-free.
        bias = {int(tok): float(val) for tok, val in (p.logit_bias or {}).items()}
        for tok, val in bias.items():
            if not 0 <= tok < vocab_size:
                raise ValueError(f"logit_bias token id {tok} out of range [0, {vocab_size})")
            rows.append(i)
            tokens.append(tok)
            values.append(val)
    if not rows:
        return None, None, None
    return (
        upload(rows, torch.int64, device),
        upload(tokens, torch.int64, device),
        upload(values, torch.float32, device),
    )
