"""The engine core: requests in, scheduled steps out to the workers, token deltas back.

``step`` is one turn of the busy loop. With zero-overhead scheduling (ZOS) it plans and launches
step N+1 *before* waiting for step N, so the CPU's scheduling work overlaps the device's; the
plan references tokens of step N that are still on the device, and step N's results are applied
after step N+1 is already running. ``--no-zos`` waits for each step before planning the next.

A request with structured output waits here, outside the scheduler, while its grammar compiles in
a thread pool (``workers.structured_output``); it is admitted when the grammar is ready, or ended
with an error output when its spec does not compile. The steps never wait for a compile.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .executor import Executor
from .expert_load_stats import ExpertLoadStats
from .protocol import AddRequest, RequestOutput, SchedulerStats, StepPlan, random_seed
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    plan: StepPlan
    handle: Any


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor):
        self.config = config
        self.executor = executor
        info = executor.info
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_blocks=info.num_blocks, num_state_slots=info.num_slots, block_size=config.block_size,
            max_model_len=info.max_model_len, eos_token_id=info.eos_token_id, dp_size=config.dp_size,
            mixed_steps=config.mixed_steps))
        self.vocab_size = info.vocab_size
        self.max_model_len = self.scheduler.max_len  # the model's limit, or less if the KV cache is smaller
        if self.max_model_len < info.max_model_len:
            log.warning("the KV cache holds %d tokens per rank, fewer than max_model_len %d: sequences are limited "
                        "to %d tokens (raise --gpu-memory-utilization, --cpu-kv-cache-gb or --num-blocks, or set "
                        "--max-model-len)", (info.num_blocks - 1) * config.block_size, info.max_model_len,
                        self.max_model_len)
        # --seed: requests without a seed get theirs from this generator, so a replay is reproducible
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        self._seq_ids = itertools.count()
        self._in_flight: InFlight | None = None
        self._compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}  # by request id
        self._grammars = None  # workers.structured_output.GrammarCache, on the first structured request
        self.expert_load = ExpertLoadStats(config.dp_size, config.eplb_stats_file)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: AddRequest) -> None:
        """Queue a request; raises ValueError with a user-facing message if it cannot run."""
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params = request.params
        if params.seed is not None:
            seed = params.seed
        else:
            seed = self._seeds.getrandbits(63) if self._seeds is not None else random_seed()
        seq = Sequence(next(self._seq_ids), request.request_id, list(ids), params, seed,
                       arrival_time=request.arrival_time or time.time())
        if params.structured is None:
            self.scheduler.add(seq)
            return
        if request.request_id in self._compiling or request.request_id in self.scheduler.by_request:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if seq.num_tokens >= self.scheduler.max_len:
            self.scheduler.add(seq)  # raises the scheduler's own message
        self._compiling[request.request_id] = (seq, self._grammar_cache().submit(params.structured))
        self.executor.prepare_grammar(params.structured)

    def _grammar_cache(self):
        if self._grammars is None:
            from workers.structured_output import grammar_cache

            try:
                self._grammars = grammar_cache(self.config.model, self.vocab_size, self.scheduler.config.eos_token_id)
            except ValueError:
                raise
            except Exception as exc:  # an unreadable tokenizer: the request's error, not the engine's
                raise ValueError(f"structured output is unavailable: {exc}") from exc
        return self._grammars

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move requests whose grammar is ready into the scheduler (arrival order); fail the invalid ones."""
        outputs = []
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                try:
                    self.scheduler.add(seq)
                    continue
                except ValueError as exc:
                    error = exc
            outputs.append(RequestOutput(request_id, [], "abort", None, seq.num_prompt_tokens, error=str(error)))
        return outputs

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (idempotent); returns a final output for each one that was live."""
        outputs = []
        for request_id in request_ids:
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                outputs.append(RequestOutput(request_id, [], "abort", None, compiling[0].num_prompt_tokens))
                continue
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                outputs.append(RequestOutput(request_id, [], "abort", None, seq.num_prompt_tokens))
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None or bool(self._compiling)

    def stats(self) -> SchedulerStats:
        return self.expert_load.fill(self.scheduler.stats())

    # ------------------------------------------------------------------ the loop body
    def step(self) -> list[RequestOutput]:
        """Plan and launch the next step; apply the results of the previous one (or of this one
        without ZOS). Returns the request outputs that became known."""
        early = self._admit_compiled() if self._compiling else []
        plan = self.scheduler.schedule()
        if plan is None and self._in_flight is None and self._compiling and not early:
            # only grammars compiling: wait for one briefly rather than spin
            concurrent.futures.wait([f for _, f in self._compiling.values()], timeout=0.005,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            return early
        launched = InFlight(plan, self.executor.submit(plan)) if plan is not None else None
        if not self.config.zos:
            return early + (self._apply(launched) if launched is not None else [])
        previous, self._in_flight = self._in_flight, launched
        return early + (self._apply(previous) if previous is not None else [])

    def _apply(self, flight: InFlight) -> list[RequestOutput]:
        results = self.executor.collect(flight.handle)
        for result in results:
            if result.error:
                raise RuntimeError(f"worker rank {result.rank} failed in step {result.step_id}: {result.error}")
        self.expert_load.add(results)
        return self.scheduler.update(results)

    def shutdown(self) -> None:
        self.expert_load.save()
        self.executor.shutdown()
