"""The DeepSeek-V4.1 network: embed, expand to hc copies, blocks, collapse, norm, head.

``V41Model.forward`` runs a flattened variable-length batch (see ``batch.py``) over explicitly
passed per-sequence state (``cache.py``) and returns the final hidden state of every token;
``logits`` turns selected rows into fp32 next-token logits. Build one with ``loader.load_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .attention import Attention, ForwardState
from .batch import ForwardBatch, SequenceChunk
from .cache import V41Cache
from .config import V41Config
from .engram import Engram, NgramHasher
from .kernels import KernelBackend
from .kernels.side_stream import Deferred
from .mhc import HyperConnection, identity_pre_mix
from .moe import MoE


@dataclass(frozen=True)
class ModelOptions:
    """How the network computes, chosen once per model.

    batch_invariant: every row's result is independent of the other rows of the batch (each
        plain GEMM row is its own product). Needed for bitwise-reproducible sampling on CPU.
    official_index_handoff: reproduce the reference's index-key hand-off on steps where a ratio-2
        index-key owner closes no group (it then scores against the keys the last publishing
        layer left behind, usually another layer's). Default off: every owner scores against its
        own keys, which makes a decode step compute what a prefill of the same prefix computes.
    reference_layout: list attention entries exactly as the official kernels do (prefill and decode
        differ; see attention_lists.py) instead of the packed, chunking-independent layout.
        With ``batch_invariant=False`` this reproduces the official CPU reference bit for bit.
    kernels: the kernel backend of the quantized products, ``reference`` or ``triton``
        (``model/kernels/``). Without ``batch_invariant`` the Triton backend takes its split-K
        decode form for products of at most 64 rows.
    pdl: programmatic dependent launch of the Triton kernels that take it (a kernel starts while the
        one before it finishes; Hopper and later: ``model/kernels/triton_dependent_launch.py``).
    max_positions: the positions the rotary tables cover (every position fed must be below it); 0: the
        config's ``max_position_embeddings``. V4.1's 1M positions make each of its two tables 256 MiB on
        every device, so the engine passes what it can reach (``workers/model_runner.py``).
    """

    batch_invariant: bool = True
    official_index_handoff: bool = False
    reference_layout: bool = False
    kernels: str = "reference"
    pdl: bool = False
    max_positions: int = 0


class Block:
    def __init__(self, layer_id: int, cfg: V41Config, attention: Attention, moe: MoE,
                 attn_norm: torch.Tensor, ffn_norm: torch.Tensor, attn_hc: HyperConnection,
                 ffn_hc: HyperConnection, engram: Engram | None, kernels: KernelBackend):
        self.layer_id, self.cfg = layer_id, cfg
        self.kernels = kernels
        self.attention, self.moe = attention, moe
        self.attn_norm, self.ffn_norm = attn_norm, ffn_norm
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc
        self.engram = engram

    def to(self, device) -> "Block":
        self.attention.to(device)
        self.moe.to(device)
        self.attn_norm, self.ffn_norm = self.attn_norm.to(device), self.ffn_norm.to(device)
        self.attn_hc.to(device)
        self.ffn_hc.to(device)
        if self.engram is not None:
            self.engram.to(device)
        return self

    def __call__(self, stream: torch.Tensor, pre_mix: torch.Tensor, batch: ForwardBatch, cache: V41Cache,
                 state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """stream [T, hc, D]; ``pre_mix`` collapses it for this attention (computed by the previous
        FFN). Returns the new stream and the mix the next block's attention collapses with."""
        eps = self.cfg.rms_norm_eps
        # Each sub-layer's mHC coefficients are read only by its expand (post, comb) and the next sub-layer's
        # collapse (pre: mHC's pre-mix is delayed by one sub-layer), so they run beside the sub-layer
        # (model/kernels/side_stream.py)
        residual = stream
        attn_coefficients = self.kernels.beside(stream, lambda: self.attn_hc.coefficients(residual))
        # the normed rows, and the same as the FP8 linears take them (model/kernels/backend.py: FP8-ready rows)
        x, x_fp8 = self.kernels.hc_collapse_and_norm_fp8_ready(stream, pre_mix, self.attn_norm, eps)
        output = self.attention(x, x_fp8, batch, cache, state)
        attn_pre, attn_post, attn_comb = attn_coefficients.result()
        stream = self.kernels.hc_expand(output, residual, attn_post, attn_comb)

        residual = stream
        ffn_coefficients = self.kernels.beside(stream, lambda: self.ffn_hc.coefficients(residual))
        x, x_fp8 = self.kernels.hc_collapse_and_norm_fp8_ready(stream, attn_pre, self.ffn_norm, eps)
        output = self.moe(x, x_fp8)
        ffn_pre, ffn_post, ffn_comb = ffn_coefficients.result()
        stream = self.kernels.hc_expand(output, residual, ffn_post, ffn_comb)
        return stream, ffn_pre


class V41Model:
    def __init__(self, cfg: V41Config, options: ModelOptions, embed: torch.Tensor, blocks: list[Block],
                 final_norm: torch.Tensor, head: torch.Tensor, hasher: NgramHasher | None, kernels: KernelBackend):
        self.cfg, self.options, self.kernels = cfg, options, kernels
        self.embed, self.blocks, self.final_norm, self.head = embed, blocks, final_norm, head
        self.hasher = hasher
        self.device = embed.device

    def to(self, device) -> "V41Model":
        self.embed, self.final_norm, self.head = (t.to(device) for t in (self.embed, self.final_norm, self.head))
        for block in self.blocks:
            block.to(device)
        if self.hasher is not None:
            self.hasher.to(device)
        self.device = torch.device(device)
        return self

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: V41Cache, state: ForwardState | None = None) -> torch.Tensor:
        """Final hidden state [T, D] (bf16, after the last collapse and the final norm).

        ``state`` may be passed in to inspect what the attention layers published (selections,
        candidates) after the forward."""
        cfg = self.cfg
        hash_ids = self.hasher(batch, cache) if self.hasher is not None else None
        stream = self.embed[batch.token_ids].unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = identity_pre_mix(batch.num_tokens, cfg.hc_mult, stream.device)
        state = state if state is not None else ForwardState()
        state.index_key_layer = self._index_key_layers(batch)
        state.shared = {}  # a state passed in again must not hand this forward the last one's lists
        lookups: dict[int, Deferred] = {}
        for i, block in enumerate(self.blocks):
            # Engram's rows depend on the token ids alone: each layer's are looked up beside the block
            # before it (model/kernels/side_stream.py)
            for ahead in self.blocks[i:i + 2]:
                if ahead.engram is not None and ahead.layer_id not in lookups:
                    ids = hash_ids[:, self.hasher.column(ahead.layer_id)]
                    lookups[ahead.layer_id] = self.kernels.beside(ids, partial(ahead.engram.look_up, ids))
            if block.engram is not None:
                stream = block.engram.gate(stream, *lookups.pop(block.layer_id).result())
            stream, pre_mix = block(stream, pre_mix, batch, cache, state)
        return self.kernels.hc_collapse_and_norm(stream, pre_mix, self.final_norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, vocab] of hidden rows [R, D] (the head's products are fp32's)."""
        return self.kernels.fp32_linear(hidden, self.head)

    # ------------------------------------------------------------------ index-key sources
    def _index_key_layers(self, batch: ForwardBatch) -> dict[int, list[int]]:
        """For every indexer layer and sequence: whose index keys it scores against."""
        cfg = self.cfg
        owners = cfg.kv_source_layers
        result: dict[int, list[int]] = {}
        for role in cfg.roles:
            if not role.runs_indexer:
                continue
            own = role.layer_id if role.owns_kv else role.kv_source
            if self.options.official_index_handoff:
                result[role.layer_id] = [self._official_key_layer(role.layer_id, own, chunk, owners)
                                         for chunk in batch.chunks]
            else:
                result[role.layer_id] = [own] * batch.num_sequences
        return result

    def _official_key_layer(self, layer: int, own: int, chunk: SequenceChunk, owners: tuple[int, ...]) -> int:
        """The reference reads the keys of whichever owner last published: owners publish only in a
        forward where their compressor closed a group (the owner itself, or one before it in this
        forward; else the last one to publish in the sequence's previous forward)."""
        ratios = self.cfg.compress_ratios

        def published(owner: int, start: int, end: int) -> bool:
            return end // ratios[owner] > start // ratios[owner]

        now = [o for o in owners if o <= layer and published(o, chunk.start, chunk.end)]
        if now:
            return max(now)
        if chunk.previous_start >= 0:
            before = [o for o in owners if published(o, chunk.previous_start, chunk.start)]
            if before:
                return max(before)
        return own
