"""The model runner of one worker: turns a step plan into a forward over the caches, and samples.

It owns the model replica, its ``V41Cache`` (paged blocks + state slots, allocated once), and the
tokens it sampled in the previous step, kept on the device: with zero-overhead scheduling a decode
input the CPU has not seen yet is taken from there (``SequenceStep.prev_row``). ``execute`` only
launches work, ending with the copies of its results into pinned host memory and an event behind
them; ``collect`` waits for that event (the one wait point), so it waits for this step alone, not
for a step launched after it: the engine core (in-process) or the worker loop (workers.step_pipeline)
launches step N+1 before collecting step N, and the device never waits for the host in between.
Constrained rows (structured output) whose input token is still on the device wait inside the step
for the previous step's copy to the host (its event, not the stream), since their grammar matchers
need that token before this step's mask can be filled (see workers.structured_output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.config import EngineConfig
from engine_core.protocol import RankBatch, SampledToken, SequenceStep, StepResult, TokenLogprob
from model.batch import ForwardBatch, SequenceChunk
from model.cache import V41Cache
from model.device_upload import upload
from model.loader import load_model
from model.transformer import ModelOptions, V41Model

from .cache_sizing import CacheCapacity, free_cuda_bytes_after_profile, plan_capacity
from .cuda_graphs import DecodeGraphs, GraphPlan, StepShape
from .expert_balancer import ExpertLoadBalancer
from .memory import limit_native_caches
from .rank_summary import log_rank_summary
from .sampler import RowSpec, SamplingBatch, prompt_logprobs, sample
from .structured_output import StructuredState, apply_bitmask
from .worker_stream import WorkerStream

log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A launched step whose results are on their way to the host."""

    step_id: int
    sequences: list[SequenceStep]
    sampled: torch.Tensor | None  # [rows with sample] token ids
    sampled_logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    sample_index: list[int]  # sequence index of each sampled row
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # seq index -> tensors
    constrained: bool = False  # some sampled row follows a grammar: its matcher takes the token at collect
    copied: torch.cuda.Event | None = None  # on CUDA: recorded after the results' copies to the host

    def copy_to_host(self, device: torch.device) -> "PendingStep":
        """On CUDA, queue the results' copies into pinned host memory behind the step's work (no
        wait) and mark their end with ``copied``. A blocking read at collect would instead wait for
        everything queued on the stream by then, the next step included."""
        if device.type != "cuda" or (self.sampled is None and not self.prompt_logprobs):
            return self

        def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to("cpu", non_blocking=True)  # pinned, asynchronous

        self.sampled, self.sampled_logprobs = host(self.sampled), host(self.sampled_logprobs)
        self.top_ids, self.top_logprobs = host(self.top_ids), host(self.top_logprobs)
        self.prompt_logprobs = {i: tuple(host(t) for t in tensors) for i, tensors in self.prompt_logprobs.items()}
        self.copied = torch.cuda.Event()
        self.copied.record()
        return self


def rope_positions(config: EngineConfig) -> int:
    """The positions the rotary tables must cover (``ModelOptions.max_positions``; 0: the model's
    ``max_position_embeddings``): those of sequences below ``--max-model-len`` and of the memory profile's
    one sequence of ``max_num_batched_tokens``. Without ``--max-model-len`` the model's own limit holds
    (1M positions for V4.1: its two tables take 512 MiB of every GPU)."""
    return max(config.max_model_len, config.max_num_batched_tokens) if config.max_model_len else 0


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, expert_parallel=None):
        """``expert_parallel``: an ExpertParallelDispatcher when experts are sharded over ranks."""
        self.config, self.rank = config, rank
        self.device = torch.device(config.device if config.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
            limit_native_caches()  # before the first forward: oneDNN reads its cache sizes once
        self.stream = WorkerStream(self.device)  # before the first kernel (workers/worker_stream.py)
        options = ModelOptions(batch_invariant=config.resolved_batch_invariant,
                               official_index_handoff=config.official_index_handoff, kernels=config.resolved_kernels,
                               pdl=config.enable_pdl, max_positions=rope_positions(config))
        expert_range = expert_parallel.expert_shard() if expert_parallel is not None else None
        self.model: V41Model = load_model(config.model, options, self.device, expert_range, config.load_format,
                                          config.engram_storage, config.model_overrides)
        self.cfg = self.model.cfg
        # under expert parallelism every rank joins every MoE all-to-all, with or without tokens
        self.always_run_forward = expert_parallel is not None
        self.expert_parallel = expert_parallel
        self.expert_balance = ExpertLoadBalancer.attach(self.model, expert_parallel, config)
        self.graph_plan = self._graph_plan()
        free = None
        if self.device.type == "cuda":
            if config.resolved_kernels == "triton" and rank == 0:  # else minutes of silence that look like a hang
                log.info("profiling memory%s: the first start on a machine also compiles the Triton kernels (minutes; "
                         "Triton's cache, ~/.triton/cache or TRITON_CACHE_DIR, keeps them for later starts)",
                         " and capturing CUDA graphs" if self.graph_plan is not None else "")
            free = free_cuda_bytes_after_profile(config, self._profile_forward)
            if self.graph_plan is not None:
                free -= self._profile_graph_memory()
        self.capacity: CacheCapacity = plan_capacity(config, self.cfg, free)
        # with graphs, one more block and slot than the engine may hand out: the padding rows' scratch
        spare = int(self.graph_plan is not None)
        self.cache = V41Cache.allocate(self.cfg, self.capacity.num_blocks + spare, self.capacity.num_slots + spare,
                                       config.block_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.graph_plan is not None:
            self.graphs = DecodeGraphs(self.model, self.cache, self.graph_plan, scratch_slot=self.capacity.num_slots,
                                       scratch_block=self.capacity.num_blocks, dispatcher=self.expert_parallel)
            self.graphs.capture_all()
        self.last_sampled = torch.full((0,), -1, dtype=torch.long, device=self.device)
        self.previous_step: PendingStep | None = None  # the step that sampled ``last_sampled``, for its host copy
        self.structured = StructuredState(config.model, self.cfg.vocab_size, self.cfg.eos_token_id)
        log_rank_summary(self)

    def _profile_forward(self) -> None:
        n = min(self.config.max_num_batched_tokens, self.cfg.max_position_embeddings)
        blocks = -(-n // self.config.block_size)
        scratch = V41Cache.allocate(self.cfg, blocks + 1, 1, self.config.block_size, self.device)
        batch = ForwardBatch.build([[0] * n], [0], [0], [list(range(1, blocks + 1))], device=self.device)
        self.model.logits(self.model.forward(batch, scratch)[-1:])
        del scratch

    def _graph_plan(self) -> GraphPlan | None:
        """What to capture as CUDA graphs, or None (and why, in the log) when decode runs eagerly."""
        config = self.config
        reason = config.cuda_graphs_off_reason
        if reason is not None:
            if self.device.type == "cuda":
                log.info("CUDA graphs off: %s", reason)
            return None
        return GraphPlan.for_engine(config, self.cfg, config.max_model_len or self.cfg.max_position_embeddings)

    def _profile_graph_memory(self) -> int:
        """Peak activation bytes of the largest graph's forward (run eagerly on a scratch cache): what
        the graphs' memory pool will hold, reserved before the cache is sized."""
        scratch = V41Cache.allocate(self.cfg, 2, 1, self.config.block_size, self.device)
        peak, (rows, key_tokens) = DecodeGraphs(self.model, scratch, self.graph_plan, scratch_slot=0, scratch_block=1,
                                                dispatcher=self.expert_parallel).activation_bytes()
        del scratch
        torch.cuda.empty_cache()
        log.info("CUDA graphs: the largest decode graph (batch %d, context %d) needs %.2f GiB of activations",
                 rows, key_tokens, peak / 2**30)
        return peak

    # ------------------------------------------------------------------ one step
    def execute(self, step_id: int, work: RankBatch, released: list[int] = (),
                shape: StepShape | None = None) -> PendingStep:
        """``released``: constrained sequences that finished (their matchers are dropped).
        ``shape``: under expert parallelism, the shape of the whole step (every rank's part), from
        which all ranks decide alike whether to replay a graph; None: this rank's part alone."""
        self.stream.enter()
        if released:
            self.structured.release(released)
        if self.expert_balance is not None:
            self.expert_balance.before_step(step_id)
        seqs = work.sequences
        bucket = self._graph_bucket(seqs, shape)
        if not seqs:
            if self.always_run_forward:  # a placeholder step: no tokens, but every all-to-all
                if bucket is not None:
                    self._replay([], bucket)
                else:
                    self.model.forward(self._forward_batch([]), self.cache)
            self.last_sampled = self.last_sampled[:0]
            self.previous_step = None
            return PendingStep(step_id, [], None, None, None, None, [], {})
        if self.expert_balance is not None:  # a graph's padding rows are no expert load
            self.expert_balance.count_rows(len(seqs) if bucket is not None else None)
        if bucket is not None:
            logits, sample_index, prompt_rows = self._replay(seqs, bucket), list(range(len(seqs))), {}
        else:
            logits, sample_index, prompt_rows = self._eager_logits(seqs)
        sampled = top_ids = top_lp = chosen_lp = None
        constrained = False
        every_row = sample_index == list(range(len(seqs)))  # a decode step: no fill and no scatter below
        last = None if every_row else torch.full((len(seqs),), -1, dtype=torch.long, device=self.device)
        if sample_index:
            sample_logits = logits[: len(sample_index)]
            constrained = self._apply_grammars(sample_logits, seqs, sample_index)
            output = sample(self._suppress(sample_logits, seqs, sample_index),
                            self._sampling_batch(seqs, sample_index))
            sampled, chosen_lp, top_ids, top_lp = (output.token_ids, output.logprobs, output.top_logprob_ids,
                                                   output.top_logprobs)
            if every_row:
                last = sampled
            else:
                last[upload(sample_index, torch.long, self.device)] = sampled
        self.last_sampled = last
        self.previous_step = None  # until this step's results are queued for the host (below)
        prompt = {}
        offset = len(sample_index)
        for i, (_, n) in prompt_rows.items():
            step = seqs[i]
            targets = upload(step.prompt_logprob_targets, torch.long, self.device)
            result = prompt_logprobs(logits[offset:offset + n], targets, step.params.prompt_logprobs or 0)
            prompt[i] = (result.token_logprobs, result.top_ids, result.top_logprobs)
            offset += n
        self.previous_step = PendingStep(step_id, seqs, sampled, chosen_lp, top_ids, top_lp, sample_index, prompt,
                                         constrained).copy_to_host(self.device)
        return self.previous_step

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a step's results on the host (the only wait of a step) and turn them into its
        ``StepResult``."""
        if pending.copied is not None:
            pending.copied.synchronize()
        tokens: dict[int, SampledToken] = {}
        if pending.sampled is not None:
            ids = pending.sampled.tolist()
            lps = pending.sampled_logprobs.tolist()
            top_ids = pending.top_ids.tolist() if pending.top_ids is not None else None
            top_lps = pending.top_logprobs.tolist() if pending.top_logprobs is not None else None
            for row, i in enumerate(pending.sample_index):
                step = pending.sequences[i]
                logprob = None
                n = step.params.logprobs
                if n is not None:
                    logprob = TokenLogprob(ids[row], lps[row], top_ids[row][:n] if n else [],
                                           top_lps[row][:n] if n else [])
                tokens[i] = SampledToken(step.seq_id, step.epoch, ids[row], logprob)
                if pending.constrained and step.params.structured is not None:
                    self.structured.accept_sampled(step.seq_id, step.epoch, step.start + len(step.token_ids), ids[row])
        for i, (lp, tids, tlps) in pending.prompt_logprobs.items():
            step = pending.sequences[i]
            entries = [TokenLogprob(t, v, a, b) for t, v, a, b in
                       zip(step.prompt_logprob_targets, lp.tolist(), tids.tolist(), tlps.tolist())]
            token = tokens.get(i) or SampledToken(step.seq_id, step.epoch, -1)
            token.prompt_logprobs = entries
            tokens[i] = token
        load = self.expert_balance.report(pending.step_id) if self.expert_balance is not None else None
        return StepResult(pending.step_id, self.rank, [tokens[i] for i in sorted(tokens)], expert_load=load)

    # ------------------------------------------------------------------ forward
    def _eager_logits(self, seqs: list[SequenceStep]):
        """(logits of the sampled rows, then of the prompt-logprob rows; which sequences sample;
        sequence index -> (first row, count) of its prompt-logprob rows) from an eager forward."""
        batch = self._forward_batch(seqs)
        hidden = self.model.forward(batch, self.cache)
        sample_index = [i for i, s in enumerate(seqs) if s.sample]
        logit_rows = [batch.offsets[i] + len(seqs[i].token_ids) - 1 for i in sample_index]
        prompt_rows = {i: (batch.offsets[i], len(s.prompt_logprob_targets))
                       for i, s in enumerate(seqs) if s.prompt_logprob_targets}
        rows = logit_rows + [o + j for o, n in prompt_rows.values() for j in range(n)]
        logits = self.model.logits(hidden[upload(rows, torch.long, self.device)]) if rows else None
        return logits, sample_index, prompt_rows

    def _graph_bucket(self, seqs: list[SequenceStep], shape: StepShape | None) -> tuple[int, int] | None:
        """The captured graph this step replays: a decode step (one sampled token per sequence, no
        prompt logprobs) within the captured batch sizes and contexts; else None (eager)."""
        if self.graphs is None:
            return None
        if self.expert_parallel is not None:
            return None if shape is None else self.graphs.bucket(shape)  # all ranks alike, or none
        return self.graphs.bucket(StepShape.of([seqs])) if seqs else None

    def _replay(self, seqs: list[SequenceStep], bucket: tuple[int, int]) -> torch.Tensor:
        self.graphs.load([s.token_ids[0] for s in seqs], [s.start for s in seqs], [s.slot for s in seqs],
                         [s.prev_row for s in seqs], [s.block_table for s in seqs], bucket, self.last_sampled)
        return self.graphs.replay(bucket, len(seqs))

    # ------------------------------------------------------------------ helpers
    def _forward_batch(self, seqs: list[SequenceStep]) -> ForwardBatch:
        # numpy on the host: an 8K-token prefill builds these before the device has any work
        flat, refs, ref_rows = [], [], []
        width = max((len(step.block_table) for step in seqs), default=1)
        tables = np.zeros((len(seqs), width), dtype=np.int64)
        for i, step in enumerate(seqs):
            if step.prev_row >= 0:
                refs.append(len(flat))
                ref_rows.append(step.prev_row)
            flat.extend(step.token_ids)
            tables[i, : len(step.block_table)] = step.block_table
        # each token's position: its chunk's start plus its index within the chunk, in a few array ops
        lengths = np.array([len(step.token_ids) for step in seqs], dtype=np.int64)
        chunk_starts = np.array([step.start for step in seqs], dtype=np.int64)
        positions = np.arange(len(flat)) + np.repeat(chunk_starts - (np.cumsum(lengths) - lengths), lengths)
        tables = upload(tables, torch.long, self.device)  # one host-to-device copy for every block table
        chunks = [SequenceChunk(step.start, len(step.token_ids), step.slot, tables[i, : len(step.block_table)],
                                step.previous_start) for i, step in enumerate(seqs)]
        token_ids = upload(flat, torch.long, self.device)
        if refs:
            # tokens sampled by the previous step, still on the device
            token_ids[upload(refs, torch.long, self.device)] = self.last_sampled[upload(ref_rows, torch.long, self.device)]
        return ForwardBatch(token_ids, upload(positions, torch.long, self.device), chunks)

    def _sampling_batch(self, seqs: list[SequenceStep], sample_index: list[int]) -> SamplingBatch:
        rows = []
        for i in sample_index:
            step = seqs[i]
            history = step.history_token_ids
            rows.append(RowSpec(step.params, step.seed, step.start + len(step.token_ids),
                                history[:step.num_prompt_tokens], history[step.num_prompt_tokens:]))
        batch = SamplingBatch.build(rows, self.cfg.vocab_size, self.device)
        # penalties must also see an output token that is still on the device
        pending = [(r, i) for r, i in enumerate(sample_index) if seqs[i].prev_row >= 0 and seqs[i].params.uses_penalties]
        if pending and (batch.output_counts is not None or batch.seen_mask is not None):
            r_idx = upload([r for r, _ in pending], torch.long, self.device)
            toks = self.last_sampled[upload([seqs[i].prev_row for _, i in pending], torch.long, self.device)]
            if batch.output_counts is not None:
                batch.output_counts.index_put_((r_idx, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
            if batch.seen_mask is not None:
                batch.seen_mask.index_put_((r_idx, toks), torch.ones_like(toks, dtype=torch.bool))
        return batch

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[SequenceStep], sample_index: list[int]) -> bool:
        """Mask the constrained rows of ``logits`` (in place) with their grammars' next-token bitmasks."""
        rows = [r for r, i in enumerate(sample_index) if seqs[i].params.structured is not None]
        if not rows:
            return False
        # inputs still on the device (zero-overhead scheduling, previous step not collected yet)
        on_device = [r for r in rows if self.structured.needs_device_input(seqs[sample_index[r]])]
        known = dict(zip(on_device, self._previous_tokens([seqs[sample_index[r]].prev_row for r in on_device])))
        states = []
        for r in rows:
            step = seqs[sample_index[r]]
            states.append(self.structured.prepare(step, step.start + len(step.token_ids), lambda r=r: known[r]))
        bitmask = self.structured.fill_bitmask(states, rows, len(sample_index), pinned=self.device.type == "cuda")
        apply_bitmask(logits, bitmask, rows, self.cfg.vocab_size)
        return True

    def _previous_tokens(self, prev_rows: list[int]) -> list[int]:
        """The tokens the previous step sampled for its rows ``prev_rows``, from its copy to the host.
        The wait is for that step's copy alone: this step's forward, queued after it, keeps running."""
        if not prev_rows:
            return []
        previous = self.previous_step
        if previous is None or previous.sampled is None:
            raise RuntimeError("a step takes its input tokens from a previous step that sampled none")
        if previous.copied is not None:
            previous.copied.synchronize()
        sampled_row = {seq_index: row for row, seq_index in enumerate(previous.sample_index)}
        tokens = previous.sampled.tolist()
        return [tokens[sampled_row[prev_row]] for prev_row in prev_rows]

    def _suppress(self, logits: torch.Tensor, seqs: list[SequenceStep], sample_index: list[int]) -> torch.Tensor:
        """Stop tokens a request may not produce yet (before min_tokens) get -inf.

        A grammar that allows nothing but EOS wins over ``min_tokens``: its row keeps EOS (the
        output is complete) rather than being left with no token at all."""
        rows, cols = [], []
        for r, i in enumerate(sample_index):
            for token in seqs[i].suppress_token_ids:
                rows.append(r)
                cols.append(token)
        if not rows:
            return logits
        suppressed = logits.clone()
        minus_inf = torch.full((), -torch.inf, device=self.device)  # a device value: a Python one is a host copy
        suppressed.index_put_((upload(rows, torch.long, self.device), upload(cols, torch.long, self.device)), minus_inf)
        if any(seqs[i].params.structured is not None for i in sample_index):
            dead = ~torch.isfinite(suppressed).any(dim=-1, keepdim=True)  # no sync: a select, not a branch
            suppressed = torch.where(dead, logits, suppressed)
        return suppressed
