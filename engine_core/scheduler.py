"""The scheduler: which sequences run in the next step, over how many tokens, in which blocks.

Pure CPU logic. Each call to ``schedule`` returns one ``StepPlan``: a prefill step (chunks of
prompts, at most ``max_num_batched_tokens`` tokens per DP rank) whenever a prompt chunk can run,
else a decode step (one token for every running sequence that is ready). With ``mixed_steps``
(``--mixed-steps``, as vLLM's chunked prefill) a step holds both: the decode rows first, then prompt
chunks in what they leave of the budget, so a decoding sequence never waits for other requests'
prompts. It is off by default: a step with prompt chunks runs eagerly (CUDA graphs cover pure
decode steps), and on GPU an eager step costs several graph steps, so mixing small prompt chunks
into most steps served fewer tokens than running the waiting prompts together in one step
(docs/benchmarks-log.md). ``update`` applies a step's sampled tokens.

With zero-overhead scheduling the engine calls ``schedule`` for step N+1 before applying step N's
results: a decode input that is still on the device is referenced by its row in the previous step
(``prev_row``), and every capacity decision is taken on what is already reserved (blocks are
allocated when a position is scheduled, not when its token is known).

Each DP rank has its own KV blocks, state slots and running list. Waiting sequences share one
FIFO queue and get a rank when they are admitted: the rank with the most free capacity
(``_pick_rank``). The head of the queue never waits while some rank could take it, and a burst
after a few long requests spreads over every rank (tests/test_dp_balance.py). When a rank runs
out of blocks during decode, its most recently arrived running sequence is preempted (as vLLM
does): its blocks and slot are freed, its epoch bumped, and it waits at the front of the queue to
be recomputed from its known tokens. Taking the newest keeps the oldest requests moving (first
come, first served) and usually throws away the least work; taking the longest output instead
would recompute the most and could preempt the same old request over and over.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from .block_pool import RefCountedPool
from .protocol import (ITERATION_TOKEN_BUCKETS, RankBatch, RequestOutput, SchedulerStats, SequenceStep, StepPlan,
                       StepResult)
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # running sequences per DP rank
    max_num_batched_tokens: int  # prefill tokens per step per DP rank
    num_blocks: int  # KV blocks per DP rank, including the padding block 0
    num_state_slots: int  # state slots per DP rank
    block_size: int  # source tokens per KV block
    max_model_len: int
    eos_token_id: int | None = None
    dp_size: int = 1
    mixed_steps: bool = False  # decode rows and prompt chunks in one step (else one kind per step)


@dataclass
class RankState:
    blocks: RefCountedPool
    slots: RefCountedPool
    running: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ranks = [
            RankState(RefCountedPool(config.num_blocks, reserved=1, name=f"kv blocks (rank {r})"),
                      RefCountedPool(config.num_state_slots, name=f"state slots (rank {r})"))
            for r in range(config.dp_size)
        ]
        # a sequence can never hold more tokens than one rank's KV blocks cover
        self.max_len = min(config.max_model_len, (config.num_blocks - 1) * config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.live: dict[int, Sequence] = {}  # waiting or running, by seq_id
        self.by_request: dict[str, Sequence] = {}
        self.next_step_id = 0
        self.rank_preemptions = [0] * config.dp_size
        self.rank_tokens_scheduled = [0] * config.dp_size  # prefill and decode tokens planned, per rank
        # planned steps by their number of tokens (ITERATION_TOKEN_BUCKETS, then +Inf), for the metrics
        self.step_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        # row of each sampling sequence in the last planned step, per rank: the prev_row of its
        # next decode input while that step's result is still on the device
        self._last_rows: dict[int, int] = {}
        self._released: list[int] = []  # finished constrained sequences not yet told to the workers

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.by_request:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        if seq.num_tokens >= self.max_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens does not fit: the limit is {self.max_len - 1} tokens "
                             f"(max_model_len {self.config.max_model_len}, KV capacity "
                             f"{(self.config.num_blocks - 1) * self.config.block_size} tokens per rank)")
        self.waiting.append(seq)
        self.live[seq.seq_id] = seq
        self.by_request[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now; idempotent (an unknown or finished id returns None)."""
        seq = self.by_request.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.live)

    @property
    def num_preemptions(self) -> int:
        return sum(self.rank_preemptions)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=sum(len(r.running) for r in self.ranks), waiting=len(self.waiting),
            kv_blocks_used=sum(r.blocks.num_used for r in self.ranks),
            kv_blocks_total=sum(r.blocks.capacity for r in self.ranks),
            state_slots_used=sum(r.slots.num_used for r in self.ranks),
            state_slots_total=sum(r.slots.capacity for r in self.ranks),
            preemptions=self.num_preemptions, step_token_counts=list(self.step_token_counts),
            step_tokens_sum=sum(self.rank_tokens_scheduled),
            rank_running=[len(r.running) for r in self.ranks],
            rank_kv_blocks_used=[r.blocks.num_used for r in self.ranks],
            rank_kv_blocks_total=[r.blocks.capacity for r in self.ranks],
            rank_state_slots_used=[r.slots.num_used for r in self.ranks],
            rank_state_slots_total=[r.slots.capacity for r in self.ranks],
            rank_preemptions=list(self.rank_preemptions), rank_tokens_scheduled=list(self.rank_tokens_scheduled))

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan | None:
        rows: list[list[SequenceStep]] = [[] for _ in self.ranks]
        if self.config.mixed_steps:
            # decode first: its preemptions only touch sequences planned before this call, and the
            # prompt chunks get the budget the decode rows leave
            self._schedule_decode(rows)
            is_prefill = self._schedule_prefill(rows, [len(rank_rows) for rank_rows in rows])
        else:
            is_prefill = self._schedule_prefill(rows)
            if not is_prefill:
                self._schedule_decode(rows)
        if not any(rows):
            return None
        rank_tokens = [sum(len(step.token_ids) for step in rank_rows) for rank_rows in rows]
        for r, count in enumerate(rank_tokens):
            self.rank_tokens_scheduled[r] += count
        self.step_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, sum(rank_tokens))] += 1
        self._last_rows = {step.seq_id: i for rank_rows in rows for i, step in enumerate(rank_rows) if step.sample}
        plan = StepPlan(self.next_step_id, is_prefill, [RankBatch(r) for r in rows], self._released)
        self._released = []
        self.next_step_id += 1
        return plan

    def _blocks_needed(self, seq: Sequence, end: int) -> int:
        """Blocks a sequence needs, beyond those it holds, to cache positions < end."""
        return max(0, -(-end // self.config.block_size) - len(seq.block_table))

    def _schedule_prefill(self, rows: list[list[SequenceStep]], decode_tokens: list[int] | None = None) -> bool:
        """Prompt chunks in the budget left by ``decode_tokens`` (per rank); True if any was planned."""
        cfg = self.config
        budgets = [cfg.max_num_batched_tokens - used for used in (decode_tokens or [0] * len(self.ranks))]
        chunks_before = sum(len(rank_rows) for rank_rows in rows)
        # chunks of prompts already admitted continue first (oldest first)
        for r, rank in enumerate(self.ranks):
            for seq in list(rank.running):
                if seq.status is SequenceStatus.RUNNING and seq.is_prefilling and budgets[r] > 0:
                    used = self._prefill_chunk(seq, rank, budgets[r], rows[r])
                    if used == 0 and not rows[r]:  # (never beside decode rows: it could preempt them)
                        used = self._unblock(seq, rank, budgets[r], rows[r])
                    budgets[r] -= used
        while self.waiting:
            seq = self.waiting[0]
            r = self._pick_rank(seq, budgets)
            if r is None:
                break  # FIFO: nothing behind the head is admitted before it
            rank = self.ranks[r]
            self.waiting.popleft()
            seq.dp_rank, seq.status = r, SequenceStatus.RUNNING
            seq.slot = rank.slots.allocate(1)[0]
            rank.running.append(seq)
            if not seq.first_scheduled_time:
                seq.first_scheduled_time = time.time()
            budgets[r] -= self._prefill_chunk(seq, rank, budgets[r], rows[r])
        return sum(len(rank_rows) for rank_rows in rows) > chunks_before

    def _pick_rank(self, seq: Sequence, budgets: list[int]) -> int | None:
        """The rank with the most free capacity among those that can take the head of the queue now.

        A rank's free capacity is its tightest limit: the smallest free fraction of its running
        seats (``max_num_seqs``), its KV blocks and its state slots. Free blocks alone would send
        every short request to a rank that has many blocks left but nearly all its seats taken:
        the ranks step in lockstep (the expert exchange), so that rank's batch would set every
        step's pace while the others run a handful of rows. Ties go to the rank running fewer
        sequences, then to the lower rank."""
        cfg = self.config
        candidates = []
        for r, rank in enumerate(self.ranks):
            first_chunk = min(seq.num_tokens, budgets[r])
            if (budgets[r] > 0 and len(rank.running) < cfg.max_num_seqs and rank.slots.can_allocate(1)
                    and rank.blocks.can_allocate(-(-first_chunk // cfg.block_size))):
                free = min(1 - len(rank.running) / cfg.max_num_seqs, rank.blocks.num_free / rank.blocks.capacity,
                           rank.slots.num_free / rank.slots.capacity)
                candidates.append((-free, len(rank.running), r))
        return min(candidates)[2] if candidates else None

    def _prefill_chunk(self, seq: Sequence, rank: RankState, budget: int, out: list[SequenceStep]) -> int:
        """Schedule the next prompt chunk of ``seq`` (as much as budget and free blocks allow)."""
        start = seq.num_cached_tokens
        end = min(seq.num_tokens, start + budget)
        affordable = (len(seq.block_table) + rank.blocks.num_free) * self.config.block_size
        end = min(end, affordable)
        if end <= start:
            return 0
        seq.block_table += rank.blocks.allocate(self._blocks_needed(seq, end))
        sample = end == seq.num_tokens
        targets: list[int] = []
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            # logits at position t predict token t + 1, so prompt targets stop at the last prompt token
            targets = seq.tokens(start + 1, min(end, seq.num_prompt_tokens - 1) + 1)
        out.append(self._step(seq, seq.tokens(start, end), sample, prompt_targets=targets,
                              structured_outputs=sample and seq.params.structured is not None))
        seq.num_cached_tokens = end
        if sample:
            seq.num_inflight_tokens += 1
            seq.prefill_done = True
        return end - start

    def _unblock(self, seq: Sequence, rank: RankState, budget: int, out: list[SequenceStep]) -> int:
        """A prompt chunk that found no free block: preempt the youngest *other* sequences until it fits.

        (Preempting the stalled prompt itself would let it be re-admitted and stall again, forever.)"""
        while seq.status is SequenceStatus.RUNNING and not rank.blocks.can_allocate(1):
            others = [s for s in rank.running if s is not seq]
            if not others:
                return 0
            self._preempt(max(others, key=lambda s: s.arrival_time))
        return self._prefill_chunk(seq, rank, budget, out)

    def _schedule_decode(self, rows: list[list[SequenceStep]]) -> None:
        for r, rank in enumerate(self.ranks):
            scheduled: list[Sequence] = []
            for seq in list(rank.running):
                if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                    continue
                if seq.num_cached_tokens != seq.num_tokens + seq.num_inflight_tokens - 1:
                    continue
                if seq.num_outputs_expected >= seq.params.max_tokens or \
                        seq.num_tokens + seq.num_inflight_tokens >= self.max_len:
                    continue  # its last token is in flight: it finishes when that arrives
                while self._blocks_needed(seq, seq.num_cached_tokens + 1) > rank.blocks.num_free:
                    victim = max(rank.running, key=lambda s: s.arrival_time)
                    self._preempt(victim)
                    if victim in scheduled:
                        scheduled.remove(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                seq.block_table += rank.blocks.allocate(self._blocks_needed(seq, seq.num_cached_tokens + 1))
                scheduled.append(seq)
            for seq in scheduled:
                position = seq.num_cached_tokens
                if seq.num_inflight_tokens:
                    step = self._step(seq, [-1], True, prev_row=self._last_rows[seq.seq_id])
                else:
                    step = self._step(seq, [seq.token_at(position)], True)
                rows[r].append(step)
                seq.num_cached_tokens += 1
                seq.num_inflight_tokens += 1

    def _step(self, seq: Sequence, token_ids: list[int], sample: bool, prev_row: int = -1,
              prompt_targets: list[int] | None = None, structured_outputs: bool = False) -> SequenceStep:
        params = seq.params
        suppress: list[int] = []
        if sample and seq.num_outputs_expected < params.min_tokens:
            suppress = list(params.stop_token_ids)
            if self.config.eos_token_id is not None and not params.ignore_eos:
                suppress.append(self.config.eos_token_id)
        step = SequenceStep(
            seq_id=seq.seq_id, epoch=seq.epoch, start=seq.num_cached_tokens, token_ids=token_ids, slot=seq.slot,
            block_table=list(seq.block_table), sample=sample, seed=seq.seed,
            params=params if (sample or prompt_targets) else None, prev_row=prev_row,
            previous_start=seq.previous_start, num_prompt_tokens=seq.num_prompt_tokens,
            history_token_ids=seq.tokens(0, seq.num_tokens) if params.uses_penalties else [],
            prompt_logprob_targets=prompt_targets or [], suppress_token_ids=suppress,
            structured_output_ids=list(seq.output_token_ids) if structured_outputs else [])
        seq.previous_start = seq.num_cached_tokens
        return step

    def _preempt(self, seq: Sequence) -> None:
        rank = self.ranks[seq.dp_rank]
        self.rank_preemptions[seq.dp_rank] += 1
        rank.running.remove(seq)
        self._release(seq, rank)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = seq.num_inflight_tokens = 0
        seq.prefill_done = False
        seq.previous_start = -1
        seq.epoch += 1
        if not seq.prompt_logprobs_done:
            seq.prompt_logprobs = None  # in-flight parts are dropped with the epoch: recompute all
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence, rank: RankState) -> None:
        rank.blocks.free(seq.block_table)
        seq.block_table = []
        if seq.slot is not None:
            rank.slots.free([seq.slot])
            seq.slot = None

    # ------------------------------------------------------------------ results
    def update(self, results: list[StepResult]) -> list[RequestOutput]:
        """Apply one step's sampled tokens; returns what each affected request gained."""
        touched: dict[int, Sequence] = {}
        for result in results:
            for sampled in result.tokens:
                seq = self.live.get(sampled.seq_id)
                if seq is None or seq.epoch != sampled.epoch:
                    continue  # finished, aborted or preempted since the step was planned
                if sampled.prompt_logprobs:
                    seq.prompt_logprobs = (seq.prompt_logprobs or []) + list(sampled.prompt_logprobs)
                    if seq.prompt_logprobs_done:
                        touched[seq.seq_id] = seq
                if sampled.token_id < 0:
                    continue  # a chunk that samples nothing (only prompt logprobs)
                seq.num_inflight_tokens -= 1
                self._append_token(seq, sampled.token_id, sampled.logprob)
                touched[seq.seq_id] = seq
        return [self._output(seq) for seq in touched.values()]

    def _append_token(self, seq: Sequence, token_id: int, logprob) -> None:
        params = seq.params
        if len(seq.output_token_ids) >= params.max_tokens:
            self._finish(seq, "length")  # max_tokens == 0: the prefill only served prompt logprobs
            return
        seq.output_token_ids.append(token_id)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        n_out = len(seq.output_token_ids)
        stops = token_id in params.stop_token_ids or (
            token_id == self.config.eos_token_id and not params.ignore_eos)
        if stops and n_out >= params.min_tokens:
            seq.stop_token_id = token_id
            self._finish(seq, "stop")
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            rank = self.ranks[seq.dp_rank]
            rank.running.remove(seq)
            self._release(seq, rank)
        seq.status = SequenceStatus.FINISHED
        if seq.params.structured is not None:
            self._released.append(seq.seq_id)
        seq.finish_reason = reason
        self.live.pop(seq.seq_id, None)
        self.by_request.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_reported:]
        seq.num_reported = len(seq.output_token_ids)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        prompt_lp = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent and seq.prompt_logprobs_done:
            prompt_lp, seq.prompt_logprobs_sent = seq.prompt_logprobs or [], True
        return RequestOutput(seq.request_id, new, seq.finish_reason, seq.stop_token_id, seq.num_prompt_tokens,
                             logprobs, prompt_lp, seq.first_scheduled_time)
