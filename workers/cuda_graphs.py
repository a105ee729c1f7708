"""CUDA graphs of the decode step: the forward and the head of a padded decode batch, replayed.

An eager decode step of a V4.1 model launches thousands of small kernels, each costing the host
several microseconds; replaying a captured graph costs one launch. A graph fixes every shape and
every address, so a decode step becomes a *padded decode* batch (``ForwardBatch.padded_decode``):

* **Batch buckets**: graphs are captured for batch sizes 1, 2, 4, 8, then every 8 up to
  ``--max-num-seqs`` (or ``--cuda-graph-sizes``); a step of n sequences replays the smallest size
  >= n. Rows beyond n point at a scratch state slot and a scratch KV block that no sequence owns
  (the cache is allocated one slot and one block larger), so what they write is never read.
* **Context buckets**: the indexer scores every compressed key up to a width fixed at capture
  (``key_tokens // ratio``), so graphs are also captured per context bucket: powers of two from
  ``MIN_CONTEXT_BUCKET`` up to ``--max-seq-len-to-capture`` (and ``--max-model-len``). A step whose
  longest sequence is beyond the last bucket runs eagerly.
* **Inputs on the device**: one int64 row per sequence (token, position, slot, row of its input in
  the previous step's samples or -1, block table) is copied to a static buffer, and the graph
  itself reads a token that zero-overhead scheduling has not shown the host yet from the previous
  step's samples (``prev_tokens``): no host round trip.
* **Expert parallelism**: every rank must run the same MoE exchanges, so under ``--dp N`` all ranks
  decide together, from the whole step plan that each of them receives (``StepShape``): a step is
  a graph step only if every rank's part is a decode batch (or empty), and every rank replays the
  graph of the busiest rank's size and the longest context, whatever its own (a rank without
  sequences replays padding rows only). Each exchange is sized for the bucket, and buckets stop
  at the dispatcher's per-peer capacity, beyond which an exchange could overflow (a host read).
* **Outputs**: the logits of the real rows, in a static buffer that the next replay overwrites
  (the runner samples from it before that). All graphs share one memory pool: they never run
  concurrently, so their intermediate tensors can share memory; the pool's size is measured at
  capture and was reserved before the cache was sized (``activation_bytes``).

Eager and graph runs of the same padded batch are the same kernels on the same inputs: their
results are bitwise equal (``tests/test_gpu.py``). The padded batch itself differs from the
general forward only in rounding: its attention sums run over every listed column
(``sparse_attention_padded``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.config import EngineConfig
from model.batch import ForwardBatch
from model.cache import V41Cache
from model.transformer import V41Model

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 1024
INPUT_COLUMNS = 4  # token, position, slot, previous-step row; then the block table


def batch_buckets(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """Batch sizes to capture: ``sizes`` if given, else 1, 2, 4, 8 and every 8 up to ``max_num_seqs``
    (always including ``max_num_seqs`` itself), capped at ``max_num_seqs``."""
    if sizes:
        return sorted({min(s, max_num_seqs) for s in sizes})
    wanted = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8)) + [max_num_seqs]
    return sorted({s for s in wanted if s <= max_num_seqs})


def context_buckets(max_context: int) -> list[int]:
    """Context lengths (tokens) to capture: powers of two from MIN_CONTEXT_BUCKET, ending at ``max_context``."""
    buckets, size = [], MIN_CONTEXT_BUCKET
    while size < max_context:
        buckets.append(size)
        size *= 2
    return buckets + [max_context]


def smallest_at_least(sizes: list[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class StepShape:
    """What decides whether a step replays a graph, and which one: of one rank's part, or (under
    expert parallelism) of every rank's, so that all ranks decide alike."""

    decode_only: bool  # every sequence decodes one token and samples it (no prompt logprobs)
    rows: int  # sequences of the busiest rank
    longest_context: int  # tokens of the longest sequence after this step
    widest_table: int  # blocks of the longest block table

    @classmethod
    def of(cls, rank_parts: list[list]) -> "StepShape":
        """``rank_parts``: the ``SequenceStep`` lists of the ranks that must agree."""
        steps = [s for part in rank_parts for s in part]
        return cls(all(len(s.token_ids) == 1 and s.sample and not s.prompt_logprob_targets for s in steps),
                   max((len(part) for part in rank_parts), default=0),
                   max((s.start + 1 for s in steps), default=0),
                   max((len(s.block_table) for s in steps), default=0))


@dataclass(frozen=True)
class GraphPlan:
    """What to capture, resolved once from the engine config."""

    batch_sizes: list[int]
    context_sizes: list[int]
    table_width: int  # block-table columns of a sequence of the longest captured context
    max_previous_rows: int  # rows of the previous step's samples a step may refer to

    @classmethod
    def from_config(cls, config: EngineConfig, max_model_len: int, exchange_rows: int | None = None) -> "GraphPlan":
        """``exchange_rows``: the most token rows an MoE exchange carries per peer without a
        second round (expert parallelism), which bounds the batch sizes."""
        longest = min(config.max_seq_len_to_capture, max_model_len)
        sizes = batch_buckets(config.max_num_seqs, config.cuda_graph_sizes)
        if exchange_rows is not None:
            sizes = [s for s in sizes if s <= exchange_rows] or [1]
        return cls(sizes, context_buckets(longest), -(-longest // config.block_size), config.max_num_seqs)

    @classmethod
    def for_engine(cls, config: EngineConfig, cfg, max_model_len: int) -> "GraphPlan":
        """The plan of an engine rank (``cfg``: the model's V4.1 config): under expert parallelism the
        batch sizes stop at the dispatcher's capacity (``workers/expert_capacity.py``)."""
        exchange_rows = None
        if config.dp_size > 1:
            from .expert_capacity import ExpertCapacity

            exchange_rows = ExpertCapacity.plan(
                config.max_num_seqs, config.max_num_batched_tokens, world_size=config.dp_size,
                num_experts=cfg.num_routed_experts, top_k=cfg.num_experts_per_token,
                capacity_factor=config.expert_capacity_factor).tokens_per_peer
        return cls.from_config(config, max_model_len, exchange_rows)

    @property
    def largest(self) -> tuple[int, int]:
        return self.batch_sizes[-1], self.context_sizes[-1]


class DecodeGraphs:
    """Captured decode graphs of one model replica and its cache, and their static buffers."""

    def __init__(self, model: V41Model, cache: V41Cache, plan: GraphPlan, scratch_slot: int, scratch_block: int,
                 dispatcher=None):
        """``dispatcher``: the expert-parallel dispatcher of the model's MoE layers, if any."""
        self.model, self.cache, self.plan, self.dispatcher = model, cache, plan, dispatcher
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        device = model.device
        rows = plan.batch_sizes[-1]
        self.inputs = torch.zeros(rows, INPUT_COLUMNS + plan.table_width, dtype=torch.long, device=device)
        self.prev_tokens = torch.zeros(max(plan.max_previous_rows, 1), dtype=torch.long, device=device)
        self.logits = torch.empty(rows, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.pool = None  # made at the first capture (run_eager also works on a CPU twin)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    # ------------------------------------------------------------------ capture
    def capture_all(self) -> None:
        """Capture every (batch, context) bucket, largest first so that smaller ones reuse its memory."""
        started, before = time.perf_counter(), torch.cuda.memory_reserved()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        for rows in reversed(self.plan.batch_sizes):
            for key_tokens in reversed(self.plan.context_sizes):
                self._capture(rows, key_tokens)
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d decode graphs (batch %s; context %s tokens) captured in %.1f s, %.2f GiB",
                 len(self.graphs), _span(self.plan.batch_sizes), _span(self.plan.context_sizes),
                 time.perf_counter() - started, (torch.cuda.memory_reserved() - before) / 2**30)

    def _capture(self, rows: int, key_tokens: int) -> None:
        self._fill_padding(rows)
        if self.dispatcher is not None:  # every rank captures the same sizes in the same order
            self.dispatcher.set_step_tokens(rows)
        self.run_eager(rows, key_tokens)  # compiles kernels and creates lazily made state, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the communicator's watchdog thread may query its events meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.run_eager(rows, key_tokens)
        self.graphs[(rows, key_tokens)] = graph

    def run_eager(self, rows: int, key_tokens: int) -> None:
        """The padded forward of the first ``rows`` input rows, without a graph (what a graph replays)."""
        inputs = self.inputs[:rows]
        previous = inputs[:, 3]
        tokens = torch.where(previous >= 0, self.prev_tokens[previous.clamp(min=0)], inputs[:, 0])
        batch = ForwardBatch.padded_decode(tokens, inputs[:, 1].contiguous(), inputs[:, 2].contiguous(),
                                           inputs[:, INPUT_COLUMNS:].contiguous(), key_tokens)
        hidden = self.model.forward(batch, self.cache)
        self.logits[:rows].copy_(self.model.logits(hidden))

    def activation_bytes(self) -> int:
        """Peak bytes the largest graph's forward allocates, measured by running it eagerly (on a
        scratch cache, before the real one is sized): what the graphs' shared pool will hold."""
        rows, key_tokens = self.plan.largest
        self._fill_padding(rows)
        if self.dispatcher is not None:
            self.dispatcher.set_step_tokens(rows)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.run_eager(rows, key_tokens)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    # ------------------------------------------------------------------ replay
    def bucket(self, shape: StepShape) -> tuple[int, int] | None:
        """The graph a step of this shape replays, if any."""
        if not shape.decode_only or shape.widest_table > self.plan.table_width:
            return None
        rows = smallest_at_least(self.plan.batch_sizes, max(shape.rows, 1))
        key_tokens = smallest_at_least(self.plan.context_sizes, shape.longest_context)
        return None if rows is None or key_tokens is None else (rows, key_tokens)

    def load(self, tokens: list[int], positions: list[int], slots: list[int], previous_rows: list[int],
             block_tables: list[list[int]], bucket: tuple[int, int], last_sampled: torch.Tensor) -> None:
        """Fill the static inputs for a step (one host-to-device copy; no synchronisation)."""
        rows, n = bucket[0], len(tokens)
        # built in a numpy array: a Python list through torch.tensor took ~20x longer at 64-256 rows
        # (0.43 / 1.8 ms against 25 / 83 us on a 2-core CPU), host time that every decode step pays
        host = np.zeros((rows, INPUT_COLUMNS + self.plan.table_width), dtype=np.int64)
        host[:n, 0], host[:n, 1], host[:n, 2], host[:n, 3] = tokens, positions, slots, previous_rows
        for i, table in enumerate(block_tables):  # unused table entries point at the padding block 0
            host[i, INPUT_COLUMNS:INPUT_COLUMNS + len(table)] = table
        host[n:] = self._padding_row
        # a fresh pinned tensor from torch's caching host allocator: it is not handed out again
        # before this asynchronous copy has run, even when the host is a step ahead of the device
        host = torch.from_numpy(host)
        if self.inputs.is_cuda:
            host = host.pin_memory()
        self.inputs[:rows].copy_(host, non_blocking=True)
        if last_sampled.numel():
            self.prev_tokens[:last_sampled.shape[0]].copy_(last_sampled)

    def replay(self, bucket: tuple[int, int], num_rows: int) -> torch.Tensor:
        """Logits [num_rows, vocab] fp32 of the loaded step (valid until the next replay)."""
        self.graphs[bucket].replay()
        return self.logits[:num_rows]

    # ------------------------------------------------------------------ helpers
    @property
    def _padding_row(self) -> list[int]:
        """A row beyond the real ones: token 0 at position 0 in the scratch slot and block."""
        return [0, 0, self.scratch_slot, -1] + [self.scratch_block] * self.plan.table_width

    def _fill_padding(self, rows: int) -> None:
        self.inputs[:rows] = torch.tensor(self._padding_row, dtype=torch.long, device=self.inputs.device)


def _span(sizes: list[int]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"
