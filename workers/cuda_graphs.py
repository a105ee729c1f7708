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
  ``MIN_CONTEXT_BUCKET`` up to ``--max-seq-len-to-capture`` (by default the longest context a
  sequence may reach). Beyond ``FULL_BATCH_CONTEXT`` a context bucket holds fewer batch sizes, and
  fewer rows (a step's padded keys grow with rows x context); a step that no bucket covers runs
  eagerly. Each bucket's static inputs hold block tables only as wide as its context needs.
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

* **One stream**: graphs are captured on the stream their steps run on, the worker's own
  (``workers/worker_stream.py``), not on a side stream: on one H200 a process that captured four
  graphs on a side stream replayed every graph ~6% slower (~0.18 µs more per kernel).

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
# every batch size is captured up to this context; longer context buckets take the powers of two
# (and the largest size) up to GRAPH_ROW_TOKENS rows x context tokens: a step's padded index keys
# take 64 bytes per row and context token (512 MiB at the limit, e.g. 256 rows of 32K tokens or 8 of
# 1M), and the graphs' shared memory, reserved before the KV cache, must hold the largest
FULL_BATCH_CONTEXT = 8192
GRAPH_ROW_TOKENS = 2**23
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
    """What to capture, resolved once from the engine config: a set of (rows, context) buckets."""

    buckets: tuple[tuple[int, int], ...]  # (rows, key_tokens), by context then rows
    block_size: int  # tokens per KV block: a bucket's block tables have table_width(key_tokens) columns
    max_previous_rows: int  # rows of the previous step's samples a step may refer to

    @classmethod
    def grid(cls, batch_sizes: list[int], context_sizes: list[int], block_size: int, max_previous_rows: int,
             long_context: int | None = None) -> "GraphPlan":
        """Every batch size at every context up to ``long_context`` tokens; beyond it, the powers of two
        and the largest size, up to ``GRAPH_ROW_TOKENS`` rows x context tokens (the smallest size is
        kept at every context)."""
        def captured(rows: int, key_tokens: int) -> bool:
            if long_context is None or key_tokens <= long_context or rows == min(batch_sizes):
                return True
            coarse = rows & (rows - 1) == 0 or rows == max(batch_sizes)
            return coarse and rows * key_tokens <= GRAPH_ROW_TOKENS

        buckets = tuple((rows, key_tokens) for key_tokens in sorted(context_sizes) for rows in sorted(batch_sizes)
                        if captured(rows, key_tokens))
        return cls(buckets, block_size, max_previous_rows)

    @classmethod
    def from_config(cls, config: EngineConfig, max_model_len: int, exchange_rows: int | None = None) -> "GraphPlan":
        """``exchange_rows``: the most token rows an MoE exchange carries per peer without a
        second round (expert parallelism), which bounds the batch sizes."""
        longest = min(config.max_seq_len_to_capture or max_model_len, max_model_len)
        sizes = batch_buckets(config.max_num_seqs, config.cuda_graph_sizes)
        if exchange_rows is not None:
            sizes = [s for s in sizes if s <= exchange_rows] or [1]
        return cls.grid(sizes, context_buckets(longest), config.block_size, config.max_num_seqs, FULL_BATCH_CONTEXT)

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
    def batch_sizes(self) -> list[int]:
        return sorted({rows for rows, _ in self.buckets})

    @property
    def context_sizes(self) -> list[int]:
        return sorted({key_tokens for _, key_tokens in self.buckets})

    def rows_at(self, key_tokens: int) -> list[int]:
        """The batch sizes captured at this context."""
        return [rows for rows, tokens in self.buckets if tokens == key_tokens]

    def table_width(self, key_tokens: int) -> int:
        """Block-table columns of a sequence of ``key_tokens`` tokens."""
        return -(-key_tokens // self.block_size)

    def input_shape(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """The static input rows of a bucket: ``INPUT_COLUMNS`` then its block-table columns."""
        rows, key_tokens = bucket
        return rows, INPUT_COLUMNS + self.table_width(key_tokens)

    @property
    def widest_rows(self) -> list[tuple[int, int]]:
        """Each context's bucket of the most rows: the buckets whose forward may need the most memory."""
        return [(max(self.rows_at(key_tokens)), key_tokens) for key_tokens in self.context_sizes]


class DecodeGraphs:
    """Captured decode graphs of one model replica and its cache, and their static buffers."""

    def __init__(self, model: V41Model, cache: V41Cache, plan: GraphPlan, scratch_slot: int, scratch_block: int,
                 dispatcher=None):
        """``dispatcher``: the expert-parallel dispatcher of the model's MoE layers, if any."""
        self.model, self.cache, self.plan, self.dispatcher = model, cache, plan, dispatcher
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        device = model.device
        # one buffer; each bucket reads its own [rows, columns] view (its block tables only as wide as
        # its context needs: the host fills and copies no more than that at every step)
        self._input_buffer = torch.zeros(max(rows * columns for rows, columns in map(plan.input_shape, plan.buckets)),
                                         dtype=torch.long, device=device)
        self.prev_tokens = torch.zeros(max(plan.max_previous_rows, 1), dtype=torch.long, device=device)
        self.logits = torch.empty(plan.batch_sizes[-1], model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.pool = None  # made at the first capture (run_eager also works on a CPU twin)
        self.capture_stream = None  # the stream the steps run on, set at capture (None: torch's side stream)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # what ``bucket`` searches at every step, per context in increasing order: (tokens, block-table
        # columns, batch sizes)
        self._contexts = [(tokens, plan.table_width(tokens), plan.rows_at(tokens)) for tokens in plan.context_sizes]

    def inputs(self, bucket: tuple[int, int]) -> torch.Tensor:
        """The static inputs [rows, INPUT_COLUMNS + table columns] of a bucket (a view of one buffer)."""
        rows, columns = self.plan.input_shape(bucket)
        return self._input_buffer[:rows * columns].view(rows, columns)

    # ------------------------------------------------------------------ capture
    def capture_all(self) -> None:
        """Capture every bucket, largest first so that smaller ones reuse its memory."""
        started, before = time.perf_counter(), torch.cuda.memory_reserved()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        # the stream the steps run on; the default stream cannot capture, so then torch's side stream
        current = torch.cuda.current_stream()
        self.capture_stream = None if current == torch.cuda.default_stream() else current
        for bucket in sorted(self.plan.buckets, key=lambda b: (b[0] * b[1], b[0]), reverse=True):
            self._capture(bucket)
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d decode graphs (batch %s; context %s tokens) captured in %.1f s, %.2f GiB",
                 len(self.graphs), _span(self.plan.batch_sizes), _span(self.plan.context_sizes),
                 time.perf_counter() - started, (torch.cuda.memory_reserved() - before) / 2**30)

    def _capture(self, bucket: tuple[int, int]) -> None:
        self._prepare(bucket)
        self.run_eager(bucket)  # compiles kernels and creates lazily made state, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the communicator's watchdog thread may query its events meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):
            self.run_eager(bucket)
        self.graphs[bucket] = graph

    def run_eager(self, bucket: tuple[int, int]) -> None:
        """The padded forward of a bucket's input rows, without a graph (what its graph replays)."""
        rows, key_tokens = bucket
        inputs = self.inputs(bucket)
        previous = inputs[:, 3]
        tokens = torch.where(previous >= 0, self.prev_tokens[previous.clamp(min=0)], inputs[:, 0])
        batch = ForwardBatch.padded_decode(tokens, inputs[:, 1].contiguous(), inputs[:, 2].contiguous(),
                                           inputs[:, INPUT_COLUMNS:].contiguous(), key_tokens)
        hidden = self.model.forward(batch, self.cache)
        self.logits[:rows].copy_(self.model.logits(hidden))

    def activation_bytes(self) -> tuple[int, tuple[int, int]]:
        """Peak bytes a graph's forward allocates, measured by running the widest bucket of every
        context eagerly (on a scratch cache, before the real one is sized), and that bucket: what the
        graphs' shared pool will hold."""
        peaks = {}
        for bucket in self.plan.widest_rows:
            self._prepare(bucket)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            self.run_eager(bucket)
            torch.cuda.synchronize()
            peaks[bucket] = torch.cuda.max_memory_allocated() - base
        largest = max(peaks, key=peaks.get)
        return peaks[largest], largest

    # ------------------------------------------------------------------ replay
    def bucket(self, shape: StepShape) -> tuple[int, int] | None:
        """The graph a step of this shape replays, if any: of the shortest context that covers it, the
        fewest rows that do."""
        if not shape.decode_only:
            return None
        for key_tokens, columns, sizes in self._contexts:
            if key_tokens >= shape.longest_context and columns >= shape.widest_table:
                rows = smallest_at_least(sizes, max(shape.rows, 1))
                if rows is not None:
                    return rows, key_tokens
        return None

    def load(self, tokens: list[int], positions: list[int], slots: list[int], previous_rows: list[int],
             block_tables: list[list[int]], bucket: tuple[int, int], last_sampled: torch.Tensor) -> None:
        """Fill the static inputs for a step (one host-to-device copy; no synchronisation)."""
        n = len(tokens)
        # built in a numpy array: a Python list through torch.tensor took ~20x longer at 64-256 rows
        # (0.43 / 1.8 ms against 25 / 83 us on a 2-core CPU), host time that every decode step pays
        host = np.zeros(self.plan.input_shape(bucket), dtype=np.int64)
        host[:n, 0], host[:n, 1], host[:n, 2], host[:n, 3] = tokens, positions, slots, previous_rows
        for i, table in enumerate(block_tables):  # unused table entries point at the padding block 0
            host[i, INPUT_COLUMNS:INPUT_COLUMNS + len(table)] = table
        host[n:] = self._padding_row(host.shape[1])
        # a fresh pinned tensor from torch's caching host allocator: it is not handed out again
        # before this asynchronous copy has run, even when the host is a step ahead of the device
        host = torch.from_numpy(host)
        if self._input_buffer.is_cuda:
            host = host.pin_memory()
        self.inputs(bucket).copy_(host, non_blocking=True)
        if last_sampled.numel():
            self.prev_tokens[:last_sampled.shape[0]].copy_(last_sampled)

    def replay(self, bucket: tuple[int, int], num_rows: int) -> torch.Tensor:
        """Logits [num_rows, vocab] fp32 of the loaded step (valid until the next replay)."""
        self.graphs[bucket].replay()
        return self.logits[:num_rows]

    # ------------------------------------------------------------------ helpers
    def _padding_row(self, columns: int) -> list[int]:
        """A row beyond the real ones: token 0 at position 0 in the scratch slot and block."""
        return [0, 0, self.scratch_slot, -1] + [self.scratch_block] * (columns - INPUT_COLUMNS)

    def _prepare(self, bucket: tuple[int, int]) -> None:
        """Inputs of padding rows only, and (expert parallelism) the exchanges sized for the bucket:
        every rank captures and measures the same buckets in the same order."""
        inputs = self.inputs(bucket)
        inputs[:] = torch.tensor(self._padding_row(inputs.shape[1]), dtype=torch.long, device=inputs.device)
        if self.dispatcher is not None:
            self.dispatcher.set_step_tokens(bucket[0])


def _span(sizes: list[int]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"
